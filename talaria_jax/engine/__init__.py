"""The paged engine: the step in three calls (scheduler -> plan, runner -> result, update), continuous
batching, sampling, grammar-constrained decoding (`grammar`), and speculative decoding (`spec/`)."""
from talaria_jax.engine import grammar
from talaria_jax.engine.compile_cache import enable_compilation_cache
from talaria_jax.engine.engine import CheckedRequest, Engine, EngineConfig, RequestError, RequestOutput, StepError
from talaria_jax.engine.sampling import SamplingError, SamplingParams
from talaria_jax.engine.spec import SpecConfig

__all__ = ["CheckedRequest", "Engine", "EngineConfig", "RequestError", "RequestOutput", "SamplingError", "SamplingParams",
           "SpecConfig", "StepError", "enable_compilation_cache", "grammar"]
