"""The trainer's reader moved to the replay buffer's client (`ReplayBufferClient.reader`); kept for old imports."""
from overworld.replay_buffer.reader import ChunkReader as ChunkReader
