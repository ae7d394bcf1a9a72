#include "autoplan/hardware.h"

#include <c10/util/Exception.h>

namespace vescale::autoplan {

namespace {

constexpr double GiB = 1024.0 * 1024.0 * 1024.0;

// DGX A100 80GB, the node of NVIDIA's Selene (the machine of Megatron-LM's published runs):
// 8 x A100-SXM4-80GB, NVLink 3 through NVSwitch (600 GB/s per GPU both ways, 300 one way),
// 8 x HDR InfiniBand 200 Gb/s = 25 GB/s per GPU one way. A100 datasheet: 312 TFLOP/s dense
// fp16/bf16, 2,039 GB/s HBM2e.
Hardware a100() {
  Hardware h;
  h.name = "a100_80gb";
  h.gpus_per_node = 8;
  h.hbm_bytes = 80 * GiB;  // nvidia-smi: 81920 MiB
  // CUDA context and kernels, NCCL's buffers per communicator, cuBLAS workspaces and the
  // caching allocator's slack: an assumption, not a measurement.
  h.reserved_bytes = 3 * GiB;
  h.peak_flops = 312e12;
  // The one number fitted to published runs: the four Megatron runs on Selene of
  // Korthikanti et al. 2022 (Table 5), the value with the least mean absolute relative
  // error over all four, grid step 0.002 (vescale.autoplan.fit_gemm_efficiency;
  // docs/benchmarks.md gives the fit, the error of each run when it is left out of the
  // fit, and the error of the prior 0.72 before fitting). It is the whole step's achieved
  // fraction of peak in the GEMMs (clocks under the power limit, kernel tails, launch
  // gaps), not a single-GEMM benchmark.
  h.gemm_efficiency = 0.744;
  // FlashAttention-2 forward/backward on A100 reaches 50-70% of peak (Dao 2023, fig. 4-6).
  h.attention_efficiency = 0.55;
  h.hbm_bw = 2.039e12;
  h.hbm_efficiency = 0.8;  // STREAM-like copies on A100 reach ~1.6-1.7 TB/s
  h.nvlink_bw = 300e9;
  h.nvlink_efficiency = 0.78;  // nccl-tests all_reduce busbw on DGX A100: ~230-240 GB/s
  h.nvlink_latency = 5e-6;
  h.ib_bw = 25e9;
  h.ib_efficiency = 0.9;  // nccl-tests across HDR nodes: ~22-23 GB/s busbw per NIC
  h.ib_latency = 10e-6;
  // NCCL runs a CTA per channel, typically 8-16 channels, on the 108 SMs: an overlapped
  // collective takes about a tenth of the GPU from the compute beside it. An assumption.
  h.overlap_compute_share = 0.1;
  return h;
}

// DGX H100: 8 x H100-SXM5-80GB, NVLink 4 through NVSwitch (900 GB/s per GPU both ways, 450
// one way), 8 x NDR InfiniBand 400 Gb/s = 50 GB/s per GPU one way. H100 SXM datasheet:
// 989 TFLOP/s dense bf16, 3,350 GB/s HBM3.
Hardware h100() {
  Hardware h;
  h.name = "h100_sxm";
  h.gpus_per_node = 8;
  h.hbm_bytes = 81559.0 * 1024 * 1024;  // what the driver reports (nvidia-smi: 81559 MiB)
  h.reserved_bytes = 3 * GiB;
  h.peak_flops = 989e12;
  // No published H100 run is fitted: the A100's fitted fraction is carried over (large
  // bf16 GEMMs on H100 reach 650-750 TFLOP/s in cuBLAS benchmarks, 0.66-0.76 of peak).
  h.gemm_efficiency = 0.744;
  // FP8 (E4M3/E5M2) dense: 1,979 TFLOP/s (the datasheet's 3,958 is with sparsity). Its
  // efficiency is fitted, as the A100's bf16 one, to published runs: NeMo 24.12's FP8
  // pre-training runs on DGX H100 (vescale.autoplan.fit_fp8_gemm_efficiency,
  // docs/benchmarks.md gives the fit and each run's error when left out of it).
  h.fp8_peak_flops = 1979e12;
  h.fp8_gemm_efficiency = 0.472;
  // cuDNN / FlashAttention-3 fused attention on H100: 500-650 TFLOP/s forward, less backward.
  h.attention_efficiency = 0.5;
  h.hbm_bw = 3.35e12;
  h.hbm_efficiency = 0.8;
  h.nvlink_bw = 450e9;
  h.nvlink_efficiency = 0.8;  // nccl-tests all_reduce busbw on DGX H100: ~360-380 GB/s
  h.nvlink_latency = 5e-6;
  h.ib_bw = 50e9;
  h.ib_efficiency = 0.9;
  h.ib_latency = 10e-6;
  h.overlap_compute_share = 0.1;  // as on A100 (132 SMs, 8-32 NCCL channels)
  return h;
}

}  // namespace

collectives::LinkCost Hardware::nvlink() const {
  return {nvlink_latency, 1.0 / (nvlink_bw * nvlink_efficiency), 1.0 / (hbm_bw * hbm_efficiency)};
}

collectives::LinkCost Hardware::ib() const {
  return {ib_latency, 1.0 / (ib_bw * ib_efficiency), 1.0 / (hbm_bw * hbm_efficiency)};
}

const Hardware& hardware(const std::string& name) {
  static const Hardware table[] = {a100(), h100()};
  for (const auto& h : table)
    if (h.name == name) return h;
  TORCH_CHECK_VALUE(false, "unknown hardware '", name, "'; known: a100_80gb, h100_sxm");
}

std::vector<std::string> hardware_names() { return {"a100_80gb", "h100_sxm"}; }

}  // namespace vescale::autoplan
