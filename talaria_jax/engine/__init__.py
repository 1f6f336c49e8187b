"""The paged engine: jitted ragged step (runner), continuous batching (engine), sampling."""
from talaria_jax.engine.compile_cache import enable_compilation_cache
from talaria_jax.engine.engine import Engine, EngineConfig, RequestError, RequestOutput, StepError
from talaria_jax.engine.sampling import SamplingError, SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestError", "RequestOutput", "SamplingError", "SamplingParams", "StepError",
           "enable_compilation_cache"]
