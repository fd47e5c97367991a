"""The rehearsal's object-store pod: moto's S3-protocol server standing in for the chart's SeaweedFS
container, with what a store on a volume has and moto has not: its data outlives the pod.

Every request is recorded (moto's recorder) in the pod's data volume, one JSON line each, before it
is applied; a new pod on the same volume replays the recording before it reports ready (GET
/healthz), so blobs written before a pod deletion are there after it, as they would be on SeaweedFS's
PersistentVolumeClaim. Moto's recorder is not made for a threaded server or a killed process: here
one request is recorded at a time (concurrent ones interleaved their lines), and a line cut short by
a kill is dropped before the replay (the request it recorded was never answered).

    python rehearsal/s3_pod.py --port 8333 --data /data
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import Any


def drop_torn_tail(recording: Path) -> None:
    """Cut the recording after its last complete line."""
    data = recording.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with recording.open("r+b") as file:
            file.truncate(end)


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

    record_one = threading.Lock()
    record_request = recorder._record_request

    def record(request: Any, body: bytes | None = None) -> None:
        with record_one:
            record_request(request, body)

    recorder._record_request = record  # type: ignore[method-assign]
    ready = threading.Event()
    moto_app = DomainDispatcherApplication(create_backend_app)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/healthz":
            status = "200 OK" if ready.is_set() else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [b"ok" if ready.is_set() else b"replaying"]
        if not ready.is_set() and environ.get("REMOTE_ADDR") != "127.0.0.1":  # the replay's own requests
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"replaying"]  # (moto records nothing while it replays)
        return moto_app(environ, start_response)

    server = make_server("0.0.0.0", args.port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    if recording.exists():
        drop_torn_tail(recording)
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
