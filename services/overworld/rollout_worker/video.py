"""Records one episode of one env slot when the rollout-manager asks, encodes it as MP4 off the env
loop, and uploads it to the manager (which stores it in its blob store). As MineStudio's EnvWorker,
each frame is the observation the action was chosen on, with the value prediction drawn on it
("vpred: 0.123"); for MinecraftSim that is what `env.render()` returns (its `obs["image"]`), less
the callbacks' overlays."""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from overworld.core.specs import Spaces
from overworld.rollout_worker.metrics import VIDEOS
from overworld.v1 import rollout_manager_pb2 as mpb

log = logging.getLogger("overworld.rollout_worker.video")

MAX_FRAMES = 10_000
CHUNK_BYTES = 1 << 20


def image_key(spaces: Spaces) -> str | None:
    """The observation that is a picture: (H, W, 3) uint8 ('image' for MineStudio, 'obs' for Crafter)."""
    for k in sorted(spaces.obs, key=lambda k: k != "image"):
        s = spaces.obs[k]
        if s.dtype == "uint8" and len(s.shape) == 3 and s.shape[-1] in (1, 3):
            return k
    return None


def draw_vpred(image: np.ndarray, vpred: float) -> np.ndarray:
    """MineStudio's draw_vpred: "vpred: %0.3f" in white, top left, about 40% of the frame wide."""
    from PIL import Image, ImageDraw, ImageFont

    frame = np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image
    picture = Image.fromarray(np.ascontiguousarray(frame[..., :3]).astype(np.uint8))
    h, w = frame.shape[:2]
    size = max(6, int(min(0.4 * w / 9, 0.2 * h)))
    try:
        font = ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        font = ImageFont.load_default()
    offset = max(1, int(min(w, h) * 0.05))
    ImageDraw.Draw(picture).text((offset, offset), f"vpred: {vpred:0.3f}", fill=(255, 255, 255), font=font)
    return np.asarray(picture)


def encode_mp4(frames: list[np.ndarray], fps: int) -> bytes:
    import imageio.v2 as imageio  # with imageio-ffmpeg's bundled ffmpeg

    with tempfile.TemporaryDirectory(prefix="overworld-video-") as tmp:
        path = Path(tmp) / "episode.mp4"
        with imageio.get_writer(path, format="FFMPEG", mode="I", fps=fps, codec="libx264", macro_block_size=1,
                                output_params=["-movflags", "+faststart"], pixelformat="yuv420p",
                                ffmpeg_log_level="error") as writer:
            for frame in frames:
                if frame.shape[-1] == 1:
                    frame = np.repeat(frame, 3, axis=-1)
                h, w = frame.shape[:2]
                writer.append_data(np.ascontiguousarray(frame[: h - h % 2, : w - w % 2]))  # type: ignore[attr-defined]  # imageio's stub: __enter__ gives the base class, no append_data
        return path.read_bytes()


class VideoRecorder:
    """Main loop: `maybe_start(slot)` when a slot begins an episode, `frame(slot, image)` before each
    action, `finish(slot, ...)` when the episode ends, `abort(slot)` if it was lost."""

    def __init__(self, key: str | None, fps: int, upload: Callable[[list[mpb.VideoChunk]], mpb.VideoInfo]) -> None:
        self.key = key
        self.fps = max(1, fps)
        self.upload = upload
        self.request_id = ""  # set by the heartbeat thread
        self.serving = ""  # the request being recorded or uploaded
        self.slot: int | None = None
        self.frames: list[np.ndarray] = []
        self.uploaded = 0
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def requested(self, request_id: str) -> None:
        with self._lock:
            if request_id and request_id != self.serving and request_id not in self._done:
                if self.key is None:
                    log.warning("video %s requested, but no observation is an (H, W, 3) uint8 image", request_id)
                self.request_id = request_id

    def maybe_start(self, slot: int) -> None:
        if self.slot is not None or self.key is None:
            return
        with self._lock:
            if not self.request_id or self.request_id == self.serving:
                return
            self.serving = self.request_id
        self.slot = slot
        self.frames = []

    def frame(self, slot_images: dict[int, np.ndarray], vpred: float | None = None) -> None:
        if self.slot is not None and self.slot in slot_images and len(self.frames) < MAX_FRAMES:
            image = np.array(slot_images[self.slot], copy=True)
            self.frames.append(draw_vpred(image, vpred) if vpred is not None else image)

    def abort(self, slot: int) -> None:
        if slot == self.slot:
            self.slot, self.frames = None, []
            with self._lock:
                self.serving = ""  # record another episode for the same request

    def finish(self, slot: int, final_image: np.ndarray, info: mpb.VideoInfo) -> None:
        if slot != self.slot:
            return
        frames = [*self.frames, np.array(final_image, copy=True)]
        self.slot, self.frames = None, []
        info.request_id = self.serving
        info.fps = self.fps
        threading.Thread(target=self._encode_and_upload, args=(frames, info), name="video-upload",
                         daemon=True).start()

    def _encode_and_upload(self, frames: list[np.ndarray], info: mpb.VideoInfo) -> None:
        try:
            data = encode_mp4(frames, self.fps)
            chunks = [mpb.VideoChunk(info=info, data=data[:CHUNK_BYTES])]
            chunks += [mpb.VideoChunk(data=data[i:i + CHUNK_BYTES]) for i in range(CHUNK_BYTES, len(data), CHUNK_BYTES)]
            stored = self.upload(chunks)
            self.uploaded += 1
            VIDEOS.inc()
            log.info("video %s uploaded: %s (%d frames, %d bytes)", info.request_id, stored.key, len(frames), len(data))
            with self._lock:
                self._done.add(info.request_id)
                if self.request_id == info.request_id:
                    self.request_id = ""
        except Exception:  # noqa: BLE001 - a failed video must never hurt the rollout
            log.exception("video %s could not be encoded or uploaded", info.request_id)
        finally:
            with self._lock:
                self.serving = ""
