"""A minimal HTTP wrapper around ONNX Runtime: bench/serving.py's peer for `estimax serve`.

Speaks TF Serving's REST ``:predict`` for one image per instance (``{"instances": [{"b64":
...}]}``) so the same client requests go to both; decodes and preprocesses each image with the
recipe the ONNX model's metadata records (estimax's own implementation of it, as a client of an
ONNX model would run it), runs ONNX Runtime on the batch and answers ``{"predictions": [...]}``.
Python's ``ThreadingHTTPServer`` (one thread per connection, HTTP/1.1 keep-alive); no batching
across requests. Not part of estimax: it exists to measure ONNX Runtime beside estimax.

    python bench/onnx_http.py MODEL.onnx PORT THREADS
"""

import base64
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import onnx
import onnxruntime as ort

from estimax.serving.preprocess import from_spec


def main() -> None:
    path, port, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    recipe = from_spec(json.loads(meta["estimax.preprocessing"]))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    # As in bench/serving.py's in-process run: spinning threads would take the cores from the
    # request's own Python work (and the client's) on a 2-core machine.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    outputs = [o.name for o in session.get_outputs()]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the bench counts, not the log
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"ready": True})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            pixels = np.stack([recipe(base64.b64decode(i["b64"])) for i in body["instances"]])
            result = dict(zip(outputs, session.run(None, {name: pixels}), strict=True))
            rows = [
                {k: np.asarray(v[i]).tolist() for k, v in result.items()}
                for i in range(len(pixels))
            ]
            self._send(200, {"predictions": rows})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
