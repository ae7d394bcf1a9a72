#pragma once
// The hardware table the planner simulates on: per-GPU compute, memory and links of
// GPU nodes (8 GPUs per node on NVLink, one InfiniBand NIC per GPU across nodes).
//
// Datasheet numbers are peaks; each comes with the fraction of it that real kernels and
// NCCL reach ("efficiency"), so that the cost model can say where a number comes from.
// hardware.cpp gives every value's source.

#include "collectives/cost_model.h"

#include <string>
#include <vector>

namespace vescale::autoplan {

struct Hardware {
  std::string name;
  int gpus_per_node = 8;
  double hbm_bytes = 0;             // memory per GPU
  double reserved_bytes = 0;        // not usable by tensors: CUDA context, NCCL buffers, allocator slack
  double peak_flops = 0;            // dense bf16/fp16 tensor-core FLOP/s
  double gemm_efficiency = 0;       // achieved fraction of peak_flops on a training step's large GEMMs
  double fp8_peak_flops = 0;        // dense FP8 tensor-core FLOP/s (0: no FP8)
  double fp8_gemm_efficiency = 0;   // achieved fraction of fp8_peak_flops, as gemm_efficiency
  double attention_efficiency = 0;  // achieved fraction of peak_flops in a fused (flash) attention kernel
  double hbm_bw = 0;                // bytes/s
  double hbm_efficiency = 0;        // achieved fraction of hbm_bw by memory-bound kernels
  double nvlink_bw = 0;             // per GPU, per direction, bytes/s
  double nvlink_efficiency = 0;     // NCCL bus bandwidth / nvlink_bw on large messages
  double nvlink_latency = 0;        // seconds per ring step inside a node
  double ib_bw = 0;                 // per GPU (its own NIC), per direction, bytes/s
  double ib_efficiency = 0;         // NCCL bus bandwidth / ib_bw on large messages
  double ib_latency = 0;            // seconds per ring step between nodes
  // Compute lost to a collective running beside it (its kernels occupy SMs and HBM
  // bandwidth): c seconds of overlapped communication slow the compute by share * c.
  double overlap_compute_share = 0;
  // Share of a layer's tensor-parallel collectives hidden behind its own GEMMs (Transformer
  // Engine's userbuffers, as Megatron-Bridge's recipes turn on with tp_comm_overlap); 0:
  // none, as in vescale today and in the Megatron-LM runs the table is validated against.
  double tp_overlap = 0;

  // The alpha-beta links of collectives/cost_model.h with the achieved bandwidths.
  collectives::LinkCost nvlink() const;
  collectives::LinkCost ib() const;
};

// "a100_80gb" (DGX A100 as in NVIDIA's Selene) or "h100_sxm" (DGX H100); raises on others,
// listing the known names.
const Hardware& hardware(const std::string& name);
std::vector<std::string> hardware_names();

}  // namespace vescale::autoplan
