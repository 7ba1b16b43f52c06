// Host harness for the CUDA kernels' per-element math (tests/unit/test_ops_cuda_host.py builds it with nvcc -x cu).
// No GPU: it runs, as host code, the very __host__ __device__ functions the kernels run (csrc/cuda/lse_math.cuh,
// csrc/cuda/gae_math.cuh), arranged as a launch arranges them: a grid of (rows x splits) blocks of kThreads threads,
// each thread's share of columns through accumulate_columns, the warp-shuffle merge trees and the split merge for
// the log-prob statistics; the tile walk, per-thread compositions, warp suffix scan and replay for the GAE scan.
// Only the shuffles and the loops over blocks/threads are emulated here (__shfl_down_sync semantics: a lane whose
// source lane is out of range reads its own value). Inputs and outputs are raw little-endian arrays in files:
//
//   harness lse f32|bf16|f64 N V ROW_STRIDE OFFSET INV_T VOCAB_START SM LOGITS TARGETS OUT
//       LOGITS: OFFSET + (N - 1) * ROW_STRIDE + V elements (the rows start OFFSET elements past a 64-byte aligned
//       base, so an odd OFFSET exercises the scalar path); TARGETS: N int64; OUT: [4, N] statistics (f64 for f64,
//       else f32). Prints "chunk C splits S".
//   harness gae f32|f64 serial|scan B T GAMMA LAM REWARDS VALUES MASK OUT
//       REWARDS, VALUES: [B, T] in the accumulation dtype; MASK: [B, T] uint8 0/1; OUT: [2, B, T] (adv, returns).
//   harness chunk N V SM    prints "chunk C splits S" (the launch shape; N = 0 must not divide by zero)
//   harness valid N V ROW_STRIDE GRAD_ROW_STRIDE    prints "args A grad G" (lse_args_valid, lse_grad_rows_valid)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/gae_math.cuh"
#include "cuda/lse_math.cuh"

using namespace mppo_cuda;

namespace {

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "harness: %s\n", msg.c_str());
  std::exit(2);
}

std::vector<char> read_file(const char* path) {
  FILE* f = std::fopen(path, "rb");
  if (!f) die(std::string("cannot open ") + path);
  std::vector<char> data;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) data.insert(data.end(), buf, buf + n);
  std::fclose(f);
  return data;
}

void write_file(const char* path, const void* data, size_t bytes) {
  FILE* f = std::fopen(path, "wb");
  if (!f || std::fwrite(data, 1, bytes, f) != bytes) die(std::string("cannot write ") + path);
  std::fclose(f);
}

// One warp's shuffle-down merge tree (block_merge in logprob_entropy.cu); the result is lane 0's.
template <typename Acc>
Triple<Acc> warp_merge(std::vector<Triple<Acc>> lanes) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const std::vector<Triple<Acc>> before = lanes;  // all lanes shuffle, then merge
    for (int lane = 0; lane < 32; ++lane) {
      const Triple<Acc>& o = lane + offset < 32 ? before[lane + offset] : before[lane];
      lanes[lane] = merge(before[lane], o);
    }
  }
  return lanes[0];
}

// block_merge: a tree per warp, then warp 0 merges the kThreads / 32 warp results (its other lanes hold the empty
// triple).
template <typename Acc>
Triple<Acc> block_merge(const std::vector<Triple<Acc>>& threads) {
  std::vector<Triple<Acc>> warp0(32, empty_triple<Acc>());
  for (int w = 0; w < kThreads / 32; ++w)
    warp0[w] = warp_merge(std::vector<Triple<Acc>>(threads.begin() + w * 32, threads.begin() + (w + 1) * 32));
  return warp_merge(warp0);
}

template <typename T, typename Acc>
void run_lse(int64_t n_rows, int64_t vocab, int64_t row_stride, int64_t offset, double inv_t, int64_t vocab_start,
             int sm, const char* logits_path, const char* target_path, const char* out_path) {
  const std::vector<char> raw = read_file(logits_path);
  const int64_t count = n_rows > 0 ? offset + (n_rows - 1) * row_stride + vocab : 0;
  if (static_cast<int64_t>(raw.size()) != count * static_cast<int64_t>(sizeof(T))) die("logits file size");
  T* base = static_cast<T*>(std::aligned_alloc(64, ((count * sizeof(T)) / 64 + 1) * 64));
  if (count) std::memcpy(base, raw.data(), raw.size());
  const std::vector<char> tgt = read_file(target_path);
  if (static_cast<int64_t>(tgt.size()) != n_rows * 8) die("targets file size");
  const int64_t* target = reinterpret_cast<const int64_t*>(tgt.data());

  const int64_t chunk = chunk_for(n_rows, vocab, sm);
  const int64_t splits = splits_for(vocab, chunk);
  std::printf("chunk %lld splits %lld\n", static_cast<long long>(chunk), static_cast<long long>(splits));
  const Acc scale = static_cast<Acc>(inv_t);
  std::vector<Acc> out(4 * n_rows);
  std::vector<Triple<Acc>> threads(kThreads);
  for (int64_t row = 0; row < n_rows; ++row) {
    const T* x = base + offset + row * row_stride;  // base[0..offset) is padding before the first row
    Triple<Acc> t = empty_triple<Acc>();
    for (int64_t split = 0; split < splits; ++split) {  // lse_partials_kernel's blocks of this row
      const int64_t start = split * chunk, stop = start + chunk < vocab ? start + chunk : vocab;
      for (int tid = 0; tid < kThreads; ++tid) {
        threads[tid] = empty_triple<Acc>();
        accumulate_columns<kThreads>(threads[tid], x, start, stop, tid, scale);
      }
      const Triple<Acc> block = block_merge(threads);
      t = splits == 1 ? block : merge(t, block);  // merge_splits_kernel: from the empty triple, split by split
    }
    const int64_t local = target[row] - vocab_start;
    out[row] = t.m;
    out[n_rows + row] = t.s;
    out[2 * n_rows + row] = t.w;
    out[3 * n_rows + row] = (local >= 0 && local < vocab) ? elem<Acc>(x[local]) * scale : Acc(0);
  }
  write_file(out_path, out.data(), out.size() * sizeof(Acc));
  std::free(base);
}

// gae_scan_kernel<Acc, kScan, kItems> on one row, host-emulated around the shared functions.
template <typename Acc>
void gae_scan_row(const Acc* r_in, const Acc* v_in, const uint8_t* m_in, Acc* adv, Acc* ret, int64_t length,
                  Acc gamma, Acc gamma_lam) {
  constexpr int THREADS = 256, ITEMS = 4, TILE = THREADS * ITEMS, WARPS = THREADS / 32;
  std::vector<Acc> s_r(TILE), s_v(TILE);
  std::vector<uint8_t> s_m(TILE);
  std::vector<Affine<Acc>> suffix(THREADS), after_me(THREADS);
  Affine<Acc> warp_total[WARPS];
  Acc warp_state[WARPS][2];
  Acc carry_n = Acc(0), carry_a = Acc(0);
  for (int64_t tile_end = length; tile_end > 0; tile_end -= TILE) {
    const int64_t tile_start = tile_end > TILE ? tile_end - TILE : 0;
    const int n = static_cast<int>(tile_end - tile_start);
    for (int i = 0; i < TILE; ++i) {  // padding = masked steps = identity maps
      const bool inside = i < n;
      s_m[i] = inside ? m_in[tile_start + i] : 0;
      s_r[i] = inside ? r_in[tile_start + i] : Acc(0);
      s_v[i] = inside ? v_in[tile_start + i] : Acc(0);
    }
    for (int tid = 0; tid < THREADS; ++tid)
      suffix[tid] = compose_items<ITEMS>(s_m.data(), s_r.data(), s_v.data(), tid * ITEMS, gamma, gamma_lam);
    for (int w = 0; w < WARPS; ++w) {  // the warp-shuffle inclusive suffix scan, then after_me = shfl_down(.., 1)
      Affine<Acc>* lanes = suffix.data() + w * 32;
      for (int offset = 1; offset < 32; offset <<= 1) {
        std::vector<Affine<Acc>> before(lanes, lanes + 32);
        for (int lane = 0; lane < 32; ++lane)
          if (lane + offset < 32) lanes[lane] = compose(before[lane], before[lane + offset]);
      }
      for (int lane = 0; lane < 32; ++lane) after_me[w * 32 + lane] = lane == 31 ? identity<Acc>() : lanes[lane + 1];
      warp_total[w] = lanes[0];
    }
    Acc n_state = carry_n, a_state = carry_a;  // thread 0's serial pass over the warp totals
    for (int w = WARPS - 1; w >= 0; --w) {
      warp_state[w][0] = n_state;
      warp_state[w][1] = a_state;
      apply(warp_total[w], n_state, a_state);
    }
    carry_n = n_state;
    carry_a = a_state;
    for (int tid = 0; tid < THREADS; ++tid) {
      Acc next_value = warp_state[tid / 32][0], last_gae = warp_state[tid / 32][1];
      apply(after_me[tid], next_value, last_gae);
      replay_items<ITEMS>(s_m.data(), s_r.data(), s_v.data(), tid * ITEMS, next_value, last_gae, gamma, gamma_lam);
    }
    for (int i = 0; i < n; ++i) {
      adv[tile_start + i] = s_r[i];
      ret[tile_start + i] = s_v[i];
    }
  }
}

// gae_serial_kernel's loop on one row.
template <typename Acc>
void gae_serial_row(const Acc* r, const Acc* v, const uint8_t* m, Acc* adv, Acc* ret, int64_t length, Acc gamma,
                    Acc gamma_lam) {
  Acc next_value = 0, last_gae = 0;
  for (int64_t t = length - 1; t >= 0; --t) {
    if (m[t]) {
      gae_step(next_value, last_gae, r[t], v[t], gamma, gamma_lam);
      adv[t] = last_gae;
      ret[t] = last_gae + v[t];
    } else {
      adv[t] = ret[t] = Acc(0);
    }
  }
}

template <typename Acc>
void run_gae(bool scan, int64_t batch, int64_t length, double gamma, double lam, const char* r_path,
             const char* v_path, const char* m_path, const char* out_path) {
  const std::vector<char> r = read_file(r_path), v = read_file(v_path), m = read_file(m_path);
  const size_t n = static_cast<size_t>(batch * length);
  if (r.size() != n * sizeof(Acc) || v.size() != n * sizeof(Acc) || m.size() != n) die("gae file sizes");
  std::vector<Acc> out(2 * n);
  const Acc g = static_cast<Acc>(gamma), gl = static_cast<Acc>(gamma * lam);  // as launch() in gae.cu
  for (int64_t b = 0; b < batch; ++b) {
    const Acc* rb = reinterpret_cast<const Acc*>(r.data()) + b * length;
    const Acc* vb = reinterpret_cast<const Acc*>(v.data()) + b * length;
    const uint8_t* mb = reinterpret_cast<const uint8_t*>(m.data()) + b * length;
    Acc* adv = out.data() + b * length;
    Acc* ret = out.data() + n + b * length;
    if (scan) gae_scan_row(rb, vb, mb, adv, ret, length, g, gl);
    else gae_serial_row(rb, vb, mb, adv, ret, length, g, gl);
  }
  write_file(out_path, out.data(), out.size() * sizeof(Acc));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) die("usage: harness lse|gae|chunk|valid ...");
  const std::string cmd = argv[1];
  auto i64 = [&](int k) { return static_cast<int64_t>(std::strtoll(argv[k], nullptr, 10)); };
  if (cmd == "lse" && argc == 13) {
    const std::string dt = argv[2];
    const int64_t n = i64(3), v = i64(4), stride = i64(5), offset = i64(6), vstart = i64(8);
    const double inv_t = std::strtod(argv[7], nullptr);
    const int sm = static_cast<int>(i64(9));
    char** files = argv + 10;
    auto run = [&](auto* tag, auto acc) {
      using T = std::remove_pointer_t<decltype(tag)>;
      run_lse<T, decltype(acc)>(n, v, stride, offset, inv_t, vstart, sm, files[0], files[1], files[2]);
    };
    if (dt == "f32") run(static_cast<float*>(nullptr), 0.0f);
    else if (dt == "bf16") run(static_cast<uint16_t*>(nullptr), 0.0f);
    else if (dt == "f64") run(static_cast<double*>(nullptr), 0.0);
    else die("dtype");
  } else if (cmd == "gae" && argc == 12) {
    const std::string dt = argv[2], algo = argv[3];
    const double gamma = std::strtod(argv[6], nullptr), lam = std::strtod(argv[7], nullptr);
    char** files = argv + 8;
    if (algo != "scan" && algo != "serial") die("algo");
    const bool scan = algo == "scan";
    if (dt == "f32") run_gae<float>(scan, i64(4), i64(5), gamma, lam, files[0], files[1], files[2], files[3]);
    else if (dt == "f64") run_gae<double>(scan, i64(4), i64(5), gamma, lam, files[0], files[1], files[2], files[3]);
    else die("dtype");
  } else if (cmd == "chunk" && argc == 5) {
    const int64_t chunk = chunk_for(i64(2), i64(3), static_cast<int>(i64(4)));
    std::printf("chunk %lld splits %lld\n", static_cast<long long>(chunk),
                static_cast<long long>(splits_for(i64(3), chunk)));
  } else if (cmd == "valid" && argc == 6) {
    mppo_logits in{};
    in.dtype = MPPO_F32;
    in.n_rows = i64(2);
    in.vocab = i64(3);
    in.row_stride = i64(4);
    in.inv_temperature = 1.0;
    std::printf("args %d grad %d\n", lse_args_valid(in) ? 1 : 0, lse_grad_rows_valid(in, i64(5)) ? 1 : 0);
  } else {
    die("bad arguments for " + cmd);
  }
  return 0;
}
