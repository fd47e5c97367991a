"""Video requests and the videos that answer them.

A request waits until a worker heartbeats; it is then handed to that worker (one request per
worker at a time). If the worker leaves before uploading, the request goes back to the queue.
Uploaded MP4s go into a blob store under `videos/<run_id>/`; `list()` gives their metadata, newest
last. The index of videos is rebuilt from the blob store's `.json` side files on restart.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format

from overworld.core.blobs.store import BlobStore
from overworld.core.blobs.urls import open_blob_store
from overworld.v1 import rollout_manager_pb2 as pb

log = logging.getLogger("overworld.rollout_manager.videos")


def video_store_url(video_output_dir: str, workdir: str = ".", blobs: str = "") -> str:
    """Where videos go: `video_output_dir` if it is absolute or s3://, else under the S3 store given
    by --blobs, else under the workdir (the embedded run: <workdir>/output/videos)."""
    if video_output_dir.startswith("s3://") or Path(video_output_dir).is_absolute():
        return video_output_dir
    if blobs.startswith("s3://"):
        return f"{blobs.rstrip('/')}/{video_output_dir.strip('/')}"
    return str(Path(workdir) / video_output_dir)


@dataclass
class Request:
    request_id: str
    iteration: int
    created: float = field(default_factory=time.time)
    worker_id: str = ""


class VideoBook:
    def __init__(self, store: BlobStore | None, store_url: str, run_id: str, interval: int, episodes: int = 1,
                 local_dir: str = "") -> None:
        self._store = store
        self.store_url = store_url
        self.episodes = max(1, episodes)  # episodes recorded per trigger (MineStudio records 4)
        # A remote store (s3://): a copy also goes under this local directory (video_output_dir).
        self.local_dir = local_dir if store_url.startswith("s3://") else ""
        self.run_id = run_id
        self.interval = interval
        self.prefix = f"videos/{run_id}/"
        self._lock = threading.Lock()
        self._queue: deque[Request] = deque()
        self._assigned: dict[str, Request] = {}  # worker_id -> request
        self._videos: list[pb.VideoInfo] = []
        self._explicit = False  # someone calls RequestVideo: the model-version trigger stands down
        self._last_trigger_version = 0
        self._loaded = False

    @property
    def store(self) -> BlobStore:
        if self._store is None:
            self._store = open_blob_store(self.store_url)
        return self._store

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            for key in self.store.keys(self.prefix):
                if key.endswith(".json"):
                    info = json_format.Parse(self.store.get(key), pb.VideoInfo())
                    self._videos.append(info)
        except (OSError, KeyError, json_format.ParseError) as err:
            log.warning("could not list earlier videos in %s: %s", self.store_url, err)
        self._videos.sort(key=lambda v: v.created_unix)

    def request(self, iteration: int, explicit: bool = True) -> str:
        """One trigger: `episodes` requests (one episode each, recorded by whichever workers heartbeat
        next). Returns the first request's id."""
        with self._lock:
            if explicit:
                self._explicit = True
            reqs = [Request(uuid.uuid4().hex[:12], iteration) for _ in range(self.episodes)]
            self._queue.extend(reqs)
        log.info("video requested (iteration %d): %d episodes, %s", iteration, len(reqs),
                 ", ".join(r.request_id for r in reqs))
        return reqs[0].request_id

    def on_model_version(self, version: int) -> None:
        """Without explicit requests, one video every `interval` model versions (≈ trainer iterations)."""
        if self.interval <= 0 or self._explicit:
            return
        with self._lock:
            due = version // self.interval > self._last_trigger_version // self.interval and version > 0
            if due:
                self._last_trigger_version = version
        if due:
            self.request(version, explicit=False)

    def assign(self, worker_id: str) -> str:
        """The request this worker should serve now ('' if none)."""
        with self._lock:
            if worker_id in self._assigned:
                return self._assigned[worker_id].request_id
            if not self._queue:
                return ""
            req = self._queue.popleft()
            req.worker_id = worker_id
            self._assigned[worker_id] = req
            return req.request_id

    def release(self, worker_id: str) -> None:
        """The worker left: its request goes back to the front of the queue."""
        with self._lock:
            req = self._assigned.pop(worker_id, None)
            if req is not None:
                req.worker_id = ""
                self._queue.appendleft(req)

    def store_video(self, info: pb.VideoInfo, data: bytes) -> pb.VideoInfo:
        with self._lock:
            self._load()
            req = self._assigned.pop(info.worker_id, None)
            if req is not None and req.request_id != info.request_id:
                self._assigned[info.worker_id] = req  # an answer to an older request; keep the current one
                req = None
        out = pb.VideoInfo()
        out.CopyFrom(info)
        if req is not None:
            out.iteration = req.iteration
        out.created_unix = time.time()
        out.size_bytes = len(data)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(out.created_unix))
        out.key = f"{self.prefix}{stamp}-{info.request_id or uuid.uuid4().hex[:12]}.mp4"
        self.store.put(out.key, data)
        self.store.put(out.key[:-4] + ".json", json_format.MessageToJson(out).encode())
        if self.local_dir:
            local = Path(self.local_dir) / out.key
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
        with self._lock:
            self._videos.append(out)
        log.info("video %s stored (%d bytes, episode return %.2f)", out.key, len(data), out.sum_reward)
        return out

    def list(self) -> list[pb.VideoInfo]:
        with self._lock:
            self._load()
            return list(self._videos)

    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._assigned)

    def describe(self) -> str:
        return json.dumps({"store": self.store_url, "pending": self.pending()})
