// fp8attn: parsing of the ops' string arguments, shared by the CPU and CUDA
// op implementations. Errors are ValueError in Python and name the argument.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <string>

#include "common/env_choice.h"
#include "common/params.h"

namespace fp8attn {

inline Precision parse_precision(c10::string_view s) {
  if (s == "fp8") return Precision::kFP8;
  if (s == "exact") return Precision::kExact;
  TORCH_CHECK_VALUE(false, "fp8attn: argument 'precision': expected \"fp8\" or \"exact\", got \"",
                    std::string(s), "\"");
}

inline DeltaMode parse_delta_mode(c10::string_view s) {
  if (s == "stale") return DeltaMode::kStale;
  if (s == "matched_do") return DeltaMode::kMatchedDO;
  if (s == "delta_matching") return DeltaMode::kDeltaMatching;
  TORCH_CHECK_VALUE(false,
                    "fp8attn: argument 'delta_mode': expected \"stale\", \"matched_do\" or "
                    "\"delta_matching\", got \"",
                    std::string(s), "\"");
}

inline Fp8Format parse_grad_format(c10::string_view s) {
  if (s == "e4m3") return Fp8Format::kE4M3;
  if (s == "e5m2") return Fp8Format::kE5M2;
  TORCH_CHECK_VALUE(false, "fp8attn: argument 'grad_format': expected \"e4m3\" or \"e5m2\", got \"",
                    std::string(s), "\"");
}

// numerics.md section 9: "row" (1x128 blocks, sections 2-3) or "tile".
inline Scaling parse_scaling(c10::string_view s) {
  if (s == "row") return Scaling::kRow;
  if (s == "tile") return Scaling::kTile;
  TORCH_CHECK_VALUE(false, "fp8attn: argument 'scaling': expected \"row\" or \"tile\", got \"",
                    std::string(s), "\"");
}

// numerics.md section 10: "none" or "hadamard".
inline QkRotation parse_qk_rotation(c10::string_view s) {
  if (s == "none") return QkRotation::kNone;
  if (s == "hadamard") return QkRotation::kHadamard;
  TORCH_CHECK_VALUE(false, "fp8attn: argument 'qk_rotation': expected \"none\" or \"hadamard\", got \"",
                    std::string(s), "\"");
}

// FP8ATTN_TILE_BWD_QSTEP (docs/architecture.md, "Environment variables"): unset / `64`
// the v5 blocks, `32` the v6 kernel's 32 x 64 P / dS blocks where it serves the problem
// (common/params.h tile_bwd_pds_rows). Read at every backward of scaling "tile", by the
// CPU op (the reference) and the CUDA op alike, so both sides of a comparison compute
// one contract; a bad value is a ValueError naming the knob (c10::ValueError: a bare
// std::invalid_argument reached Python as RuntimeError on the newest torch, 2026-12-07 CI).
inline int tile_pds_rows_of_env(const AttnParams& p) {
  if (p.scaling != Scaling::kTile) return 0;
  int v = -1;
  try {
    v = env_choice("FP8ATTN_TILE_BWD_QSTEP", {"64", "32"});
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return tile_bwd_pds_rows(p, v == 1 ? 32 : 64);
}

}  // namespace fp8attn
