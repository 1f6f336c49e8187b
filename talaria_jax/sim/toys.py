"""Hand-computable hardware and models (1 GPU, round numbers): the simulator's mock engine for tests."""
from talaria_jax.sim.hardware import GB, GIB, HardwareConfig, ModelShape

# 30 GB usable HBM; 1 TFLOP/s; 100 GB/s HBM; 10 GB/s PCIe; 100 GB/s D2D; no all-reduce (1 GPU)
TOY_HW = HardwareConfig(
    name="toy", num_gpus=1, hbm_gib_per_gpu=30e9 / GIB, memory_utilization=1.0, hbm_bw_gbps=100.0,
    hbm_bw_efficiency=1.0, matmul_tflops=1.0, prefill_efficiency=1.0, nvlink_gbps=1.0, allreduce_latency_us=0.0, step_overhead_us=0.0,
    pcie_h2d_gbps=10.0, pcie_d2h_gbps=10.0, weight_load_efficiency=1.0, d2d_gbps=100.0, host_memory_gb=1000.0,
    host_reserve_gb=0.0)


def toy_model(name: str, weights_gb: float = 10.0) -> ModelShape:
    """Dense, 1B active (2 GFLOP/token), 1 layer, 1 MB of KV per token, attention dim 1000, on 1 GPU."""
    return ModelShape(name=name, weight_bytes=weights_gb * GB, active_params_b=1.0, layers=1, full_attn_layers=1,
                      kv_bytes_per_token=1_000_000, attn_dim=1000, hidden=1000, num_experts=0, top_k=0,
                      expert_fraction=0.0, tp=1)


TOY_SHAPES = {m: toy_model(m) for m in ("m1", "m2", "m3")}
