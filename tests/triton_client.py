"""Send image files to a package's Triton model, all at once, one request each, with tritonclient (HTTP).

Runs in the side venv of ``make triton`` (tests/triton_env.py). The model's name and its input and
output names are the package's (``package.json: triton``), not spelt here.

    python triton_client.py HOST:PORT PACKAGE IMAGE [IMAGE ...]

prints ``{file name: {"latex": ...} | {"error": ...}}`` as JSON.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def main() -> None:
    url, package, paths = sys.argv[1], Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
    triton = json.loads((package / "package.json").read_text())["triton"]
    client = httpclient.InferenceServerClient(url, concurrency=len(paths), network_timeout=600.0)
    pending = []
    for path in paths:  # every request in flight before the first answer is read
        image = httpclient.InferInput(triton["input"], [1, 1], "BYTES")
        image.set_data_from_numpy(np.array([[path.read_bytes()]], dtype=np.object_))
        pending.append(client.async_infer(triton["model"], [image],
                                          outputs=[httpclient.InferRequestedOutput(triton["output"])]))
    answers = {}
    for path, request in zip(paths, pending):
        try:
            latex = request.get_result().as_numpy(triton["output"]).reshape(-1)[0]
            answers[path.name] = {"latex": latex.decode("utf-8")}
        except InferenceServerException as exc:
            answers[path.name] = {"error": str(exc)}
    client.close()
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
