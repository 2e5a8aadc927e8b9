"""The ways the CUDA device can await a GPU event from asyncio (`EngineConfig.event_wait`).

cuda_device.py implements them and docs/cuda.md compares them. The names live here, in a module
without torch, so the API's config (params.py) validates the field from the runtime's own list
instead of the runtime importing the API's config.
"""

EVENT_WAITS = ("auto", "host_func", "thread", "poll")
