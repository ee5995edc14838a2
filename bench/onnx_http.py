"""A minimal HTTP wrapper around ONNX Runtime: bench/serving.py's peer for `estimax serve`.

Speaks TF Serving's REST ``:predict`` for one image per instance (``{"instances": [{"b64":
...}]}``) so the same client requests go to both; decodes and preprocesses each image with the
recipe the ONNX model's metadata records (estimax's own implementation of it, as a client of an
ONNX model would run it), runs ONNX Runtime on the batch and answers ``{"predictions": [...]}``.
Python's ``ThreadingHTTPServer`` (one thread per connection, HTTP/1.1 keep-alive); no batching
across requests. Not part of estimax: it exists to measure ONNX Runtime beside estimax.
``GET /stats`` answers where its time went (``{"requests": n, "seconds": {phase: total}}``:
``parse`` the JSON and base64, ``prepare`` decoding and preprocessing, ``run`` ONNX Runtime,
``answer`` the JSON written), as estimax's ``/v2/models/NAME/stats`` does for estimax.

    python bench/onnx_http.py MODEL.onnx PORT THREADS
"""

import base64
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import onnx
import onnxruntime as ort

from estimax.export.preprocess import from_spec


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
    lock = threading.Lock()
    stats = {"requests": 0, "seconds": dict.fromkeys(("parse", "prepare", "run", "answer"), 0.0)}

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
            if self.path == "/stats":
                with lock:
                    self._send(200, json.loads(json.dumps(stats)))
                return
            self._send(200, {"ready": True})

        def do_POST(self):
            t0 = time.perf_counter()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            images = [base64.b64decode(i["b64"]) for i in body["instances"]]
            t1 = time.perf_counter()
            pixels = np.stack([recipe(image) for image in images])
            t2 = time.perf_counter()
            result = dict(zip(outputs, session.run(None, {name: pixels}), strict=True))
            t3 = time.perf_counter()
            rows = [
                {k: np.asarray(v[i]).tolist() for k, v in result.items()}
                for i in range(len(pixels))
            ]
            self._send(200, {"predictions": rows})
            t4 = time.perf_counter()
            with lock:
                stats["requests"] += 1
                times = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
                for phase, seconds in zip(stats["seconds"], times, strict=True):
                    stats["seconds"][phase] += seconds

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
