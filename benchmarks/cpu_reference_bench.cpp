// fp8attn: CPU reference benchmark. Times forward + backward of the fp8 path
// (delta_matching) and of the exact path for batch=2, heads=8, seqlen=512,
// head_dim=64 (BF16 inputs/outputs, [B, S, H, D] layout), median of a few
// runs, and prints wall-clock seconds, plus the process CPU seconds (all
// threads) of fwd+bwd, which stay meaningful on a busy machine.
//
// Usage: cpu_reference_bench [runs=5] [num_threads=0] [causal=0] [paths=both|fp8|exact]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "common/params.h"
#include "reference/attention_ref.h"

using namespace fp8attn;

namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> x(n);
  for (auto& e : x) e = to_bf16(nd(rng));
  return x;
}

TensorView view(std::vector<uint16_t>& x, int64_t S, int64_t H, int64_t D) {
  TensorView t;
  t.data = x.data();
  t.dtype = DType::kBFloat16;
  t.stride_batch = S * H * D;
  t.stride_seq = H * D;
  t.stride_head = D;
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int runs = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 0;
  const bool causal = argc > 3 && std::atoi(argv[3]) != 0;
  const std::string paths = argc > 4 ? argv[4] : "both";
  const int64_t B = 2, H = 8, S = 512, D = 64;

  std::mt19937 rng(1234);
  const size_t n = static_cast<size_t>(B * S * H * D);
  auto q = random_bf16(n, rng), k = random_bf16(n, rng), v = random_bf16(n, rng),
       dout = random_bf16(n, rng);
  std::vector<uint16_t> o(n), dq(n), dk(n), dv(n);
  std::vector<float> lse(static_cast<size_t>(B * H * S));

  AttnParams p;
  p.batch = B;
  p.seqlen_q = p.seqlen_k = S;
  p.num_heads_q = p.num_heads_kv = H;
  p.head_dim_qk = p.head_dim_v = D;
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(D));
  p.causal = causal;
  p.delta_mode = DeltaMode::kDeltaMatching;
  p.num_threads = threads;

  std::printf("cpu_reference_bench: B=%ld H=%ld S=%ld d=%ld causal=%d threads=%d runs=%d\n",
              static_cast<long>(B), static_cast<long>(H), static_cast<long>(S),
              static_cast<long>(D), causal ? 1 : 0, threads, runs);
  for (Precision prec : {Precision::kFP8, Precision::kExact}) {
    if (paths != "both" && paths != (prec == Precision::kFP8 ? "fp8" : "exact")) continue;
    p.precision = prec;
    std::vector<double> tf, tb, tc;
    for (int r = 0; r < runs; ++r) {
      const std::clock_t c0 = std::clock();
      const auto t0 = std::chrono::steady_clock::now();
      attention_forward_ref(p, view(q, S, H, D), view(k, S, H, D), view(v, S, H, D),
                            view(o, S, H, D), lse.data());
      const auto t1 = std::chrono::steady_clock::now();
      attention_backward_ref(p, view(q, S, H, D), view(k, S, H, D), view(v, S, H, D),
                             view(o, S, H, D), view(dout, S, H, D), lse.data(), view(dq, S, H, D),
                             view(dk, S, H, D), view(dv, S, H, D), nullptr);
      const auto t2 = std::chrono::steady_clock::now();
      tc.push_back(static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC);
      tf.push_back(std::chrono::duration<double>(t1 - t0).count());
      tb.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
    const double f = median(tf), b = median(tb);
    std::printf(
        "%-5s  forward %.3f s  backward %.3f s  fwd+bwd %.3f s  (cpu %.3f s; median of %d)\n",
        prec == Precision::kFP8 ? "fp8" : "exact", f, b, f + b, median(tc), runs);
  }
  return 0;
}
