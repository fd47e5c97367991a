"""A stand-in for NVIDIA's DCGM exporter in the rehearsal, whose node has no GPU: it serves
`DCGM_FI_DEV_GPU_UTIL` for each GPU the node's device plugin handed to a pod, labelled as
dcgm-exporter labels it with its Kubernetes mapping on (`gpu`, `UUID`, `device`, `modelName`,
`Hostname`, and the holder's `namespace`, `pod`, `container`). The utilisation is 0: no GPU computes
here. What it shows is whether the dashboard's GPU panel selects the release's GPU pods by their names.

    python rehearsal/dcgm_standin.py --port 9400 --holders HOLDERS.json

HOLDERS.json (rewritten by the rehearsal as pods come and go): [{"namespace", "pod", "container"}, ...].
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def exposition(holders: list[dict[str, str]]) -> str:
    lines = ["# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).", "# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    for index, holder in enumerate(holders):
        labels = {"gpu": str(index), "UUID": f"GPU-rehearsal-{index}", "device": f"nvidia{index}",
                  "modelName": "rehearsal stand-in (no GPU)", "Hostname": "rehearsal-node", **holder}
        rendered = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"DCGM_FI_DEV_GPU_UTIL{{{rendered}}} 0")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9400)
    parser.add_argument("--holders", type=Path, required=True)
    args = parser.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            try:
                holders = json.loads(args.holders.read_text())
            except (OSError, ValueError):
                holders = []
            body = exposition(holders).encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
            pass

    ThreadingHTTPServer(("0.0.0.0", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
