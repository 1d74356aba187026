// fp8attn: parsing of the ops' string arguments, shared by the CPU and CUDA
// op implementations. Errors are ValueError in Python and name the argument.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <string>

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

}  // namespace fp8attn
