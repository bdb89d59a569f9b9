"""Export an EAGLE drafter to ONNX (see specserve/methods/eagle/export.py for the I/O).

    python training/export_onnx.py --target models/demo/target --drafter models/demo/eagle --out DIR

Writes DIR/eagle_backbone.onnx and DIR/calibration_head.onnx, checks both with onnx.checker and
compares onnxruntime with torch on shapes other than the export example (max |diff| <= --tol).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specserve.model.transformer import load_model
from specserve.methods.eagle.drafter import load_eagle
from specserve.methods.eagle.export import export

__all__ = ["export", "main"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args(argv)
    target = load_model(args.target)
    report = export(target, load_eagle(args.drafter, target), args.out, args.tol)
    print(f"wrote {report.backbone} (max |ort - torch| = {report.backbone_max_abs_diff:.2e})")
    if report.calibration:
        print(f"wrote {report.calibration} (max |ort - torch| = {report.calibration_max_abs_diff:.2e})")


if __name__ == "__main__":
    sys.exit(main())
