"""The rehearsal's object-store pod: moto's S3-protocol server standing in for the chart's SeaweedFS
container, with what a store on a volume has and moto has not: its data outlives the pod.

Every request is recorded (moto's recorder) in the pod's data volume; a new pod on the same volume
replays the recording before it reports ready (GET /healthz), so blobs written before a pod deletion
are there after it, as they would be on SeaweedFS's PersistentVolumeClaim.

    python tests/cluster/s3_pod.py --port 8333 --data /data
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8333)
    parser.add_argument("--data", type=Path, default=Path("/data"))
    args = parser.parse_args(argv)
    args.data.mkdir(parents=True, exist_ok=True)
    recording = args.data / "requests.jsonl"
    os.environ["MOTO_ENABLE_RECORDING"] = "true"
    os.environ["MOTO_RECORDER_FILEPATH"] = str(recording)

    from moto.moto_api import recorder
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    ready = threading.Event()
    moto_app = DomainDispatcherApplication(create_backend_app)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/healthz":
            status = "200 OK" if ready.is_set() else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [b"ok" if ready.is_set() else b"replaying"]
        return moto_app(environ, start_response)

    server = make_server("0.0.0.0", args.port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    if recording.exists():
        recorder.replay_recording(target_host=f"http://127.0.0.1:{args.port}")
    ready.set()
    print(f"S3 server on :{args.port}, data in {args.data} (replayed: {recording.exists()})", flush=True)

    import signal

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
