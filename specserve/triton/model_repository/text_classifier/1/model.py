"""text_classifier: the text-type gate's classifier (specserve.serving.text_gate.TextClassifier: features in
numpy, the MLP under onnxruntime). Its version folder holds model.onnx and config.json."""

from pathlib import Path

from specserve.serving.text_classifier import TextClassifier
from specserve.triton import pb
from specserve.serving import schema


class TritonPythonModel:
    def initialize(self, args):
        self.clf = TextClassifier(Path(args["model_repository"]) / args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = pb.input_scalar(request, schema.GATE_TEXT)
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                found = self.clf.classify(text)
                responses.append(pb.response({schema.TEXT_TYPE: found.text_type,
                                              schema.TEXT_TYPE_PROB: [found.prob]}))
            except Exception as e:  # noqa: BLE001 — answer this request, keep the others
                responses.append(pb.error_response(f"text_classifier: {type(e).__name__}: {e}"))
        return responses
