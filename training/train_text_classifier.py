"""Train the text-type gate's classifier (code / structured text vs natural language) offline and
export it to ONNX: models/demo/text_classifier/{model.onnx, config.json, data_manifest.json,
heldout_sample.jsonl, eval.json}.

Data, split by source DOCUMENT into train / held-out (held-out figures are on documents never
trained on); samples are prompt-sized (a few lines, 30..600 characters):

  code   * windows of 2..20 lines of the stdlib sources of the demo corpus (training/corpus.py, its
           train / held-out split), docstrings cut out (they are prose);
         * function headers with their docstring's first line (how code prompts look);
         * structured text made here by a seeded generator: JSON, YAML, CSV, XML, HTML, INI,
           shell, SQL, logs, Markdown tables (held-out: another seed and other vocabulary);
  prose  * docstring paragraphs and comment blocks of the same stdlib files (doctest and
           indented example paragraphs left out);
         * pydoc help-topic paragraphs (indented example and grammar paragraphs left out);
         * English prose of the machine, when present: the license texts in
           /usr/share/common-licenses and the package READMEs in /usr/share/doc (plain paragraphs
           only; split by file / package, a quarter held out; the manifest records each text's
           sha256: another machine has other files, so its figures differ).

The 40 prompts of models/demo/heldout_prompts.jsonl come from held-out documents only and are
never trained on; they are evaluated separately (the realistic check).

Features: specserve.serving.text_classifier.features (the one implementation serving uses). Model: an MLP
D → 32 → 2, torch, seeded, one thread.

    python training/train_text_classifier.py [--out models/demo/text_classifier] [--threads 1]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import random
import sys
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "training"))
import corpus  # noqa: E402

from specserve.serving.text_classifier import (CONFIG_FILE, MODEL_FILE, TEXT_TYPES, ClassifierConfig,  # noqa: E402
                                               FeatureParams, TextClassifier, featurize)

OUT = REPO / "models" / "demo" / "text_classifier"
LICENSES = Path("/usr/share/common-licenses")
DOCS = Path("/usr/share/doc")
SPLIT_SALT = "specserve-text-gate-v1"
SYSTEM_HELDOUT = 0.25
SEED = 0
MIN_CHARS, MAX_CHARS = 30, 600
HIDDEN = 32


@dataclass(frozen=True)
class Sample:
    text: str
    label: str      # "code" | "prose"
    source: str     # the kind of source, for per-source accuracy
    doc: str        # the document it came from


# -- stdlib: code windows, function prompts, docstrings, comments ------------------------------------
def _docstring_nodes(tree: ast.AST) -> list[ast.Constant]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.append(first.value)
    return out


def _is_prose_paragraph(p: str) -> bool:
    """A paragraph of plain text: no doctest, no indented (example / grammar) lines."""
    lines = [ln for ln in p.splitlines() if ln.strip()]
    return bool(lines) and ">>>" not in p and "::=" not in p and not any(ln.startswith((" ", "\t")) for ln in lines)


def _prose_runs(paras: list[str]) -> list[str]:
    """One piece per prose paragraph: it and the prose paragraphs right after it (a prompt may
    hold several), joined by blank lines."""
    out = []
    for i, p in enumerate(paras):
        if not _is_prose_paragraph(p):
            continue
        run = [p]
        for q in paras[i + 1:]:
            if not _is_prose_paragraph(q) or sum(map(len, run)) > MAX_CHARS:
                break
            run.append(q)
        out.append("\n\n".join(run))
    return out


def _cut(text: str, rng: random.Random) -> str | None:
    """A prompt-sized piece: a random length in [MIN_CHARS, MAX_CHARS], cut anywhere (prompts end
    mid-word too)."""
    text = text.strip("\n")
    if len(text) < MIN_CHARS:
        return None
    return text[:rng.randint(MIN_CHARS, min(MAX_CHARS, len(text)))]


def _code_windows(lines: list[str], rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n * 3):
        if len(out) >= n or len(lines) < 2:
            break
        k = rng.randint(2, 20)
        start = rng.randrange(0, max(1, len(lines) - k))
        window = lines[start:start + k]
        body = [ln for ln in window if ln.strip()]
        if not body or all(ln.lstrip().startswith("#") for ln in body):
            continue
        text = "".join(window)
        while len(text) > MAX_CHARS and len(window) > 2:
            window = window[:-1]
            text = "".join(window)
        if MIN_CHARS <= len(text) <= MAX_CHARS:
            out.append(text)
    return out


def _comment_blocks(source: str) -> list[str]:
    blocks, cur, last = [], [], -2
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                line = tok.start[0]
                if line != last + 1 and cur:
                    blocks.append(" ".join(cur))
                    cur = []
                text = tok.string.lstrip("#").strip()
                if text and not text.startswith(("!", "-*-", "noqa", "type:", "pragma")):
                    cur.append(text)
                last = line
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    if cur:
        blocks.append(" ".join(cur))
    return [b for b in blocks if len(b) >= MIN_CHARS]


def stdlib_samples(doc: corpus.Document, rng: random.Random) -> list[Sample]:
    try:
        tree = ast.parse(doc.text)
    except SyntaxError:
        return []
    lines = doc.text.splitlines(keepends=True)
    doc_lines: set[int] = set()
    prose: list[str] = []
    for c in _docstring_nodes(tree):
        doc_lines.update(range(c.lineno, (c.end_lineno or c.lineno) + 1))
        text = ast.get_docstring(ast.Module(body=[ast.Expr(c)], type_ignores=[]), clean=True) or ""
        # Paragraphs are judged on the cleaned docstring (an indented one there is an example);
        # half are shown as they stand in the source, continuation lines indented (how a
        # docstring looks in a prompt).
        indent = " " * (c.col_offset or 4)
        prose += [p.replace("\n", "\n" + indent).replace("\n" + indent + "\n", "\n\n") if rng.random() < 0.5 else p
                  for p in _prose_runs(text.split("\n\n"))]
    code_lines = [ln for i, ln in enumerate(lines, 1) if i not in doc_lines]
    n = max(1, min(30, len(code_lines) // 25))
    out = [Sample(t, "code", "stdlib code", doc.name) for t in _code_windows(code_lines, rng, n)]
    funcs = corpus._function_prompts(doc)
    out += [Sample(p["prompt"], "code", "function prompt", doc.name)
            for p in rng.sample(funcs, min(8, len(funcs))) if len(p["prompt"]) >= 20]
    out += [Sample(t, "prose", "docstring", doc.name) for t in (_cut(p, rng) for p in prose) if t]
    comments = _comment_blocks(doc.text)
    out += [Sample(t, "prose", "comment", doc.name) for t in (_cut(c, rng) for c in comments) if t]
    return out


def topic_samples(doc: corpus.Document, rng: random.Random) -> list[Sample]:
    paras = [p for p in doc.text.split("\n\n") if "****" not in p]
    out = [Sample(t, "prose", "help topic", doc.name) for t in (_cut(r, rng) for r in _prose_runs(paras)) if t]
    for p in paras:
        if not _is_prose_paragraph(p) and ">>>" not in p and "::=" not in p and len(p.strip()) >= MIN_CHARS:
            # An indented example: Python code (left-stripped of the topic's 3-space indent).
            out.append(Sample("\n".join(ln[3:] for ln in p.splitlines())[:MAX_CHARS], "code", "help topic example",
                              doc.name))
    return out


# -- English prose of the system: licenses, package READMEs -------------------------------------------
def system_split(name: str) -> str:
    """A quarter of these documents held out (the stdlib corpus holds out 6%, too few of ~300)."""
    u = int.from_bytes(hashlib.sha256(f"{SPLIT_SALT}:{name}".encode()).digest()[:8], "big") / 2**64
    return "heldout" if u < SYSTEM_HELDOUT else "train"


def _read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def system_docs() -> list[tuple[str, str, str, str]]:
    """(source, name, split, text) of each license file and package README present."""
    out = []
    if LICENSES.is_dir():
        for p in sorted(LICENSES.iterdir()):
            if p.is_file():
                name = f"common-licenses/{p.name}"
                out.append(("license", name, system_split(name), _read(p)))
    if DOCS.is_dir():
        for p in sorted(DOCS.glob("*/README*")):
            if p.is_file() and not p.is_symlink() and p.suffix in ("", ".gz", ".md", ".txt", ".Debian", ".rst"):
                name = f"doc/{p.parent.name}/{p.name}"
                # Split by package: a package's READMEs are all train or all held-out.
                out.append(("readme", name, system_split(f"doc/{p.parent.name}"), _read(p)))
    return out


def system_samples(source: str, name: str, text: str, rng: random.Random) -> list[Sample]:
    """Plain-English paragraphs only: mostly letters, no indented (command / code) lines, no
    Markdown code fences or shell prompts; half re-flowed onto one line."""
    paras = []
    for p in text.split("\n\n"):
        p = p.strip("\n")
        if (len(p) < MIN_CHARS or not _is_prose_paragraph(p) or "```" in p or "$ " in p or "{" in p
                or len(p.split()) < 6 or sum(c.isalpha() or c.isspace() for c in p) < 0.85 * len(p)):
            continue
        paras.append(" ".join(p.split()) if rng.random() < 0.5 else p)
    rng.shuffle(paras)
    return [Sample(t, "prose", source, name) for t in (_cut(p, rng) for p in paras[:40]) if t]


# -- generated structured text ---------------------------------------------------------------------
WORDS = {
    "train": ("user id name email status created updated price quantity total order item product city country "
              "region host port timeout retries level path version enabled owner group size count score rate "
              "title author date tags comment").split(),
    "heldout": ("account uuid label phone state modified amount stock invoice sku zone address server endpoint "
                "interval backoff verbosity directory release active maintainer team width height weight "
                "latency subject editor published category note").split(),
}


def _value(rng: random.Random, words: list[str]):
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randint(0, 10 ** rng.randint(1, 6))
    if kind == 1:
        return round(rng.uniform(-1000, 1000), rng.randint(1, 4))
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(words) + "_" + str(rng.randint(0, 99))
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))


def _record(rng: random.Random, words: list[str], depth: int = 0) -> dict:
    d = {}
    for _ in range(rng.randint(2, 6)):
        key = rng.choice(words)
        if depth < 2 and rng.random() < 0.2:
            d[key] = _record(rng, words, depth + 1)
        elif depth < 2 and rng.random() < 0.15:
            d[key] = [_value(rng, words) for _ in range(rng.randint(1, 4))]
        else:
            d[key] = _value(rng, words)
    return d


def _yaml(d: dict, indent: int = 0) -> str:
    out = []
    for k, v in d.items():
        pad = " " * indent
        if isinstance(v, dict):
            out.append(f"{pad}{k}:\n{_yaml(v, indent + 2)}")
        elif isinstance(v, list):
            out.append(f"{pad}{k}:\n" + "".join(f"{pad}  - {json.dumps(x)}\n" for x in v))
        else:
            out.append(f"{pad}{k}: {json.dumps(v) if isinstance(v, str) and ':' in v else ('null' if v is None else v)}\n")
    return "".join(out)


def _flat(rng, words):
    return {k: v for k, v in _record(rng, words).items() if not isinstance(v, (dict, list))} or {"id": 1}


def structured(kind: str, rng: random.Random, words: list[str]) -> str:
    w = lambda: rng.choice(words)  # noqa: E731
    if kind == "json":
        return json.dumps([_record(rng, words) for _ in range(rng.randint(1, 3))], indent=rng.choice([None, 2, 4]))
    if kind == "yaml":
        return _yaml(_record(rng, words))
    if kind == "csv":
        cols = rng.sample(words, rng.randint(3, 7))
        rows = [",".join(str(_value(rng, words)) for _ in cols) for _ in range(rng.randint(2, 12))]
        return ",".join(cols) + "\n" + "\n".join(rows) + "\n"
    if kind == "xml":
        rec = _flat(rng, words)
        inner = "".join(f"    <{k}>{v}</{k}>\n" for k, v in rec.items())
        return f'<?xml version="1.0"?>\n<{w()} id="{rng.randint(1, 999)}">\n{inner}</{w()}>\n'
    if kind == "html":
        items = "".join(f'    <li class="{w()}"><a href="/{w()}/{rng.randint(1, 99)}">{w()} {w()}</a></li>\n'
                        for _ in range(rng.randint(1, 6)))
        return f'<div id="{w()}">\n  <h2>{w().title()}</h2>\n  <ul>\n{items}  </ul>\n</div>\n'
    if kind == "ini":
        return "".join(f"[{w()}]\n" + "".join(f"{k} = {v}\n" for k, v in _flat(rng, words).items()) + "\n"
                       for _ in range(rng.randint(1, 3)))
    if kind == "shell":
        cmds = [f"export {w().upper()}_{w().upper()}={rng.randint(1, 9999)}",
                f"mkdir -p /var/lib/{w()}/{w()}", f"cd \"$HOME/{w()}\" || exit 1",
                f"for f in *.{w()[:3]}; do\n  echo \"$f\"\ndone",
                f"if [ -z \"${w().upper()}\" ]; then\n  echo '{w()} missing' >&2\nfi",
                f"grep -rn '{w()}' ./{w()} | head -n {rng.randint(1, 50)}",
                f"curl -sSf http://localhost:{rng.randint(1000, 9999)}/{w()} -o /tmp/{w()}.json",
                f"tar -czf {w()}.tar.gz {w()}/ && rm -rf {w()}/"]
        return "#!/bin/sh\nset -eu\n" * (rng.random() < 0.3) + "\n".join(rng.sample(cmds, rng.randint(2, 6))) + "\n"
    if kind == "sql":
        t, cols = w() + "s", rng.sample(words, rng.randint(2, 5))
        sep = rng.choice(["\n", " "])      # one line or several
        text = rng.choice([
            f"SELECT {', '.join(cols)}{sep}FROM {t}{sep}WHERE {cols[0]} {rng.choice(['=', '>', '<', '<>'])} "
            f"{rng.randint(1, 99)}{sep}ORDER BY {cols[-1]} {rng.choice(['ASC', 'DESC'])};\n",
            f"SELECT COUNT(*) FROM {t} WHERE {cols[0]} LIKE '%{w()}%'{sep}GROUP BY {cols[-1]};\n",
            f"DELETE FROM {t} WHERE {cols[0]} IS NULL;\n",
            f"CREATE TABLE {t} (\n" + ",\n".join(f"  {c} {rng.choice(['INTEGER', 'TEXT', 'REAL', 'VARCHAR(64)'])}"
                                                 for c in cols) + "\n);\n",
            f"INSERT INTO {t} ({', '.join(cols)}) VALUES ({', '.join(repr(_value(rng, words)) for _ in cols)});\n",
            f"UPDATE {t} SET {cols[0]} = {rng.randint(0, 9)} WHERE {cols[1]} IN (SELECT {cols[1]} FROM {w()}s);\n"])
        return text.lower() if rng.random() < 0.3 else text
    if kind == "log":
        return "".join(f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)}T{rng.randint(10, 23)}:{rng.randint(10, 59)}:"
                       f"{rng.randint(10, 59)}Z {rng.choice(['INFO', 'WARN', 'ERROR', 'DEBUG'])} [{w()}] "
                       f"{w()}={_value(rng, words)} {w()}={rng.randint(0, 999)}ms\n" for _ in range(rng.randint(2, 8)))
    if kind == "markdown_table":
        cols = rng.sample(words, rng.randint(2, 5))
        rows = "".join("| " + " | ".join(str(_value(rng, words)) for _ in cols) + " |\n" for _ in range(rng.randint(1, 6)))
        return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n" + rows
    raise ValueError(kind)


STRUCTURED_KINDS = ("json", "yaml", "csv", "xml", "html", "ini", "shell", "sql", "log", "markdown_table", "sql")


def structured_samples(split: str, n: int) -> list[Sample]:
    rng = random.Random(f"{SEED}:structured:{split}")
    out = []
    for i in range(n):
        kind = STRUCTURED_KINDS[i % len(STRUCTURED_KINDS)]
        text = structured(kind, rng, WORDS[split])
        if len(text) > MAX_CHARS:
            text = text[:rng.randint(MAX_CHARS // 2, MAX_CHARS)]
        out.append(Sample(text, "code", f"structured {kind}", f"generated:{split}:{kind}"))
    return out


# -- the data set ----------------------------------------------------------------------------------
def build(split: str, manifest: dict) -> list[Sample]:
    out: list[Sample] = []
    for doc in corpus.documents(manifest, split):
        rng = random.Random(f"{SEED}:{doc.name}")
        out += topic_samples(doc, rng) if doc.name.startswith("topics:") else stdlib_samples(doc, rng)
    for source, name, s, text in system_docs():
        if s == split:
            out += system_samples(source, name, text, random.Random(f"{SEED}:{name}"))
    n_code = sum(x.label == "code" for x in out)
    n_prose = len(out) - n_code
    # Structured text: a third of the code class; then the larger class is subsampled (balanced).
    out += structured_samples(split, max(200, n_code // 2))
    n_code = sum(x.label == "code" for x in out)
    rng = random.Random(f"{SEED}:balance:{split}")
    code = [x for x in out if x.label == "code"]
    prose = [x for x in out if x.label == "prose"]
    if n_code > n_prose:   # subsample the larger class, deterministically
        code = rng.sample(code, n_prose)
    else:
        prose = rng.sample(prose, n_code)
    return code + prose


def manifest_of(train: list[Sample], heldout: list[Sample]) -> dict:
    def counts(samples):
        by = {}
        for s in samples:
            by.setdefault(s.label, {}).setdefault(s.source, 0)
            by[s.label][s.source] += 1
        return by
    system = [{"name": n, "split": s, "bytes": len(t.encode()), "sha256": hashlib.sha256(t.encode()).hexdigest()}
              for _, n, s, t in system_docs()]
    return {"description": "text-type gate data; see training/train_text_classifier.py",
            "stdlib": "models/demo/corpus_manifest.json (the demo corpus, its train / held-out split)",
            # Texts of the training machine's /usr/share (Debian): names relative to it, sha256 of
            # the (decompressed) text; another machine's differ, and the figures with them.
            "system_prose": system or "absent on the training machine",
            "structured": {"kinds": list(STRUCTURED_KINDS), "seed": SEED,
                           "vocabulary": {k: len(v) for k, v in WORDS.items()}},
            "samples": {"train": counts(train), "heldout": counts(heldout)}}


def evaluate(clf: TextClassifier, samples: list[Sample]) -> dict:
    p = clf.p_code([s.text for s in samples])
    pred = np.where(p >= clf.cfg.threshold, "code", "prose")
    truth = np.array([s.label for s in samples])
    conf = {t: {q: int(((truth == t) & (pred == q)).sum()) for q in TEXT_TYPES} for t in TEXT_TYPES}
    by_source = {}
    for src in sorted({s.source for s in samples}):
        idx = [i for i, s in enumerate(samples) if s.source == src]
        by_source[src] = {"n": len(idx), "accuracy": round(float((pred[idx] == truth[idx]).mean()), 4)}
    wrong = [{"label": samples[i].label, "p_code": round(float(p[i]), 3), "source": samples[i].source,
              "text": samples[i].text[:160]} for i in np.flatnonzero(pred != truth)[:12]]
    return {"n": len(samples), "accuracy": round(float((pred == truth).mean()), 4),
            "confusion (rows: truth, cols: predicted)": conf, "by_source": by_source, "some_errors": wrong}


def train(args) -> None:
    import torch
    from tqdm import tqdm

    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    manifest = corpus.load_manifest()
    t0 = time.time()
    train_s, held_s = build("train", manifest), build("heldout", manifest)
    params = FeatureParams()
    x = torch.from_numpy(featurize([s.text for s in tqdm(train_s, desc="features")], params))   # [N, D]
    y = torch.tensor([TEXT_TYPES.index(s.label) for s in train_s])                               # [N]
    print(f"data: {len(train_s)} train / {len(held_s)} held-out samples, {time.time() - t0:.0f} s")

    model = torch.nn.Sequential(torch.nn.Linear(params.dim, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(SEED)
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x), generator=gen)
        total = 0.0
        for i in tqdm(range(0, len(x), args.batch), desc=f"epoch {epoch}", leave=False):
            idx = perm[i:i + args.batch]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        print(f"epoch {epoch}: train loss {total / len(x):.4f}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ClassifierConfig(features=params)
    export = torch.nn.Sequential(model, torch.nn.Softmax(dim=-1)).eval()
    with torch.no_grad():
        torch.onnx.export(export, (x[:2],), str(out / MODEL_FILE), input_names=[cfg.input_name],
                          output_names=[cfg.output_name], opset_version=17, dynamo=False,
                          dynamic_axes={cfg.input_name: {0: "B"}, cfg.output_name: {0: "B"}})
        want = export(x[:64]).numpy()
    (out / CONFIG_FILE).write_text(cfg.to_json() + "\n")
    clf = TextClassifier(out)
    got = clf.session.run([cfg.output_name], {cfg.input_name: x[:64].numpy()})[0]
    assert np.abs(got - want).max() < 1e-5, "onnxruntime differs from torch"

    prompts = [json.loads(ln) for ln in corpus.PROMPTS.read_text().splitlines() if ln.strip()]
    demo = [Sample(p["prompt"], p["kind"], f"demo {p['kind']} prompt", p["source"]) for p in prompts]
    report = {"heldout": evaluate(clf, held_s), "train": {k: v for k, v in evaluate(clf, train_s).items()
                                                           if k in ("n", "accuracy")},
              "demo_heldout_prompts": evaluate(clf, demo),
              "model": {"params": sum(p.numel() for p in model.parameters()), "hidden": HIDDEN,
                        "feature_dim": params.dim, "onnx_bytes": (out / MODEL_FILE).stat().st_size},
              "training": {"epochs": args.epochs, "batch": args.batch, "seed": SEED, "threads": args.threads,
                           "wall_s": round(time.time() - t0, 1)}}
    (out / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "data_manifest.json").write_text(json.dumps(manifest_of(train_s, held_s), indent=1) + "\n")
    # A fixed held-out sample for the test: 200 per class, spread over the sources; package
    # READMEs left out (their text is not ours to redistribute).
    rng = random.Random(f"{SEED}:test-sample")
    sample = [s for label in TEXT_TYPES for group in [[s for s in held_s if s.label == label and s.source != "readme"]]
              for s in rng.sample(group, min(200, len(group)))]
    with open(out / "heldout_sample.jsonl", "w") as f:
        for s in sample:
            f.write(json.dumps({"label": s.label, "source": s.source, "doc": s.doc, "text": s.text}) + "\n")
    h = report["heldout"]
    print(f"held-out accuracy {h['accuracy']:.4f} on {h['n']} samples; demo prompts "
          f"{report['demo_heldout_prompts']['accuracy']:.4f}; onnx {report['model']['onnx_bytes']} bytes")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=128)
    train(ap.parse_args(argv))


if __name__ == "__main__":
    main()
