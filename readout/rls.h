// Recursive least squares on the readout, exact and batched (docs/MATH.md).
//
// For a finished batch U (k x (d+1), rows u = [z; 1]) with targets y:
//   V = P U';  S = I + U V;  G = V S^-1;  theta += G (y - U theta);
//   P -= G V'.
// After any sequence of batches theta equals the anchored closed form
//   (P0^-1 + sum U_i' U_i)^-1 (P0^-1 theta0 + sum U_i' y_i).
//
// Implementation: with S = L L' (Cholesky), G V' = W W' where W = V L^-T,
// so the P update is a symmetric rank-k downdate. Those are deferred: P is
// kept as P_base - W_all W_all' with the pending columns W_all. A batch of
// up to 8 makes one pass over P_base's upper triangle that folds the (at
// most 8) pending columns and computes V with the folded values (the fused
// sweep: P read and written once); a wider batch streams P_base once with
// a blocked matrix product (compute-bound: P is streamed once for all k
// rows) and subtracts the pending part, and the pending columns are folded
// with one blocked rank-k update every `fold_columns` columns. Products
// with P and the folds run on `threads` threads. P is FP32, symmetric by
// construction (only the upper triangle is updated, in blocks of 96 rows,
// diagonal blocks whole; everything reads only those blocks, and the lower
// triangle is mirrored only when P() needs it), and its loss of positive
// definiteness is detected: S = I + U P U' has all Cholesky pivots >= 1 in
// exact arithmetic, so a pivot below 1/2 rejects the batch, the state
// (P_base - W_all W_all', theta) unchanged.
#ifndef LEAP_READOUT_RLS_H_
#define LEAP_READOUT_RLS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "Eigen/Core"
#include "absl/status/status.h"

namespace leap::readout {

namespace internal {
struct Kernels;
}  // namespace internal

// A dense symmetric n x n FP32 matrix, both triangles stored, row-major,
// rows padded to a multiple of 16 floats and 64-byte aligned.
class SymMatrix {
 public:
  SymMatrix() = default;
  explicit SymMatrix(int64_t n);
  SymMatrix(const SymMatrix& other);
  SymMatrix& operator=(const SymMatrix& other);
  SymMatrix(SymMatrix&&) noexcept = default;
  SymMatrix& operator=(SymMatrix&&) noexcept = default;

  // s * I.
  static SymMatrix ScaledIdentity(int64_t n, float s);
  // From a double matrix; symmetrized as (A + A') / 2.
  static SymMatrix FromDouble(const Eigen::MatrixXd& a);

  int64_t n() const { return n_; }
  int64_t ld() const { return ld_; }
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  float* row(int64_t i) { return data_.get() + i * ld_; }
  const float* row(int64_t i) const { return data_.get() + i * ld_; }
  float operator()(int64_t i, int64_t j) const { return data_[i * ld_ + j]; }
  float& operator()(int64_t i, int64_t j) { return data_[i * ld_ + j]; }
  Eigen::MatrixXd ToDouble() const;
  // Copies the upper triangle onto the lower one.
  void MirrorUpper();
  // Bytes of the packed n*n payload (no padding).
  int64_t payload_bytes() const { return n_ * n_ * 4; }

 private:
  struct Free {
    void operator()(float* p) const;
  };
  int64_t n_ = 0;
  int64_t ld_ = 0;
  std::unique_ptr<float[], Free> data_;
};

// A full symmetric copy of p from its blocks on and above the diagonal of
// internal::kSymBlock-row blocks only (what RlsState::SharedP guarantees).
SymMatrix CopySymmetric(const SymMatrix& p);

// The cores this process may run on (its CPU affinity mask), at least 1.
int AvailableCores();

// RLS tuning.
struct RlsOptions {
  // Pending rank-1 columns folded into P with one SYRK. Larger amortizes the
  // fold better but costs 2 * fold_columns * k * (d+1) extra flops per batch
  // for the pending correction. Default: 256
  int fold_columns = 256;
  // Threads for a batch's products with P and for the fold; 0 = the cores
  // this process may run on (sched_getaffinity). Work is split by rows or
  // columns of P and every entry is summed in the same order whatever the
  // split, so the result does not depend on the thread count. Default: 0
  int threads = 0;
  // Kernel set by name ("portable", "avx2", "avx512"); empty = the best
  // this CPU supports. Validate() rejects a set the CPU lacks. Default: ""
  std::string kernels;
  // Which code computes batches wider than the fused sweep's (the product
  // U P_base and the fold of the pending columns): "openblas" (OpenBLAS's
  // SGEMM/SSYMM/SSYRK, run single-threaded in fixed pieces on this
  // state's threads; OpenBLAS's own thread count is set to 1), "kernels"
  // (the hand kernels of `kernels`), or empty: OpenBLAS when the kernels
  // OpenBLAS picked for this CPU are AVX-512 and so are `kernels`, else the
  // hand kernels. Default: ""
  std::string large_batches;

  absl::Status Validate() const;
};

// Cumulative seconds spent in each phase of RlsState's updates (for
// benchmarks: where the time goes): the updating thread's CPU time with one
// thread, wall time with several.
struct RlsPhaseSeconds {
  double sweep = 0;    // batches of <= 8: one pass over P's upper triangle
                       // that folds the pending columns and computes U P
  double product = 0;  // wider batches: U P_base (blocked)
  double pending = 0;  // minus the pending part (U W_all') W_all
  double solve = 0;    // S = I + U V (FP64), Cholesky, theta
  double w = 0;        // the pending columns W' = L^-1 V'
  double fold = 0;     // P_base -= W_all W_all' (upper triangle)
  double mirror = 0;   // upper triangle copied onto the lower one (only
                       // for P() after a fold)
  double total() const {
    return sweep + product + pending + solve + w + fold + mirror;
  }
};

// Call once at process start, before any thread runs: sets OpenBLAS to one
// thread for the whole process now (instead of lazily from an RLS thread
// while another thread may be inside an OpenBLAS call). Every batch's k x k
// Cholesky (LAPACK dpotrf, dtrtri) would otherwise run on OpenBLAS's own
// thread pool, whose workers keep spinning (sched_yield) after each call on
// the cores the RLS threads and the server need: at d = 4096, batches of
// 256 on 2 RLS threads, 4,393-4,553 completions/s with OpenBLAS's default
// threads vs 5,268-5,432 with one (AMD EPYC, 2 cores). Where RlsState's
// default sends wide batches to OpenBLAS (its AVX-512 kernels), the RLS
// threads run its calls in fixed pieces of their own. Other OpenBLAS users
// in the process (the bootstrap ridge fit) then run on one thread too.
// Returns whether RlsState's default sends wide batches to OpenBLAS here.
bool PrepareOpenBlasForRls();

// The RLS state of one readout: theta (FP64) and P (FP32).
// Not thread-safe: one thread (the readout's RLS worker) owns it; publish
// copies of theta to readers.
class RlsState {
 public:
  // theta has n = d + 1 entries; p is n x n, symmetric positive definite.
  RlsState(Eigen::VectorXd theta, SymMatrix p, RlsOptions options = {});

  // Applies one finished batch. `u` holds k rows of n floats (row stride
  // `ldu` floats) of standardized augmented features [z; 1]; `y` the k
  // targets. FailedPrecondition when P has lost positive definiteness or
  // inputs are not finite: nothing changes then.
  absl::Status Update(const float* u, int64_t ldu, std::span<const double> y);

  // Folds the pending columns into P.
  void Flush();

  const Eigen::VectorXd& theta() const { return theta_; }
  // P with every update applied (flushes first; mirrors the upper triangle
  // onto the lower one if a fold left it stale).
  const SymMatrix& P();
  // P with every update applied (flushes first), shared without a copy and
  // without the mirror: only its blocks on and above the diagonal of
  // internal::kSymBlock-row blocks are meaningful, and they stay unchanged
  // while the pointer is held (the next fold copies P first if it is still
  // held). For copying P off the updating thread (CopySymmetric), e.g. for
  // a checkpoint. The pointer may be read on another thread.
  std::shared_ptr<const SymMatrix> SharedP();
  int64_t n() const { return theta_.size(); }
  int64_t pending_columns() const { return pending_; }
  // Completions applied since construction.
  int64_t updates() const { return updates_; }
  const RlsOptions& options() const { return options_; }
  // Threads actually used (options().threads, or the available cores).
  int threads() const { return threads_; }
  // Name of the kernel set in use ("avx512", "avx2" or "portable").
  const char* kernel_name() const;
  // What computes batches wider than 8: "openblas <its kernel family>"
  // (e.g. "openblas SkylakeX") or the kernel set's name.
  std::string large_batch_variant() const;

  // Where the time of every Update and Flush so far went.
  const RlsPhaseSeconds& phase_seconds() const { return phases_; }

  // OK when every diagonal entry of P (pending included) is finite and > 0.
  absl::Status CheckHealth();

 private:
  absl::Status UpdateChunk(const float* u, int64_t ldu,
                           std::span<const double> y);
  // Vt (k rows of ld floats, padding zero) = U P_base - (U W_all') W_all.
  void ComputeVt(const float* u, int64_t ldu, int64_t k);
  // For k <= kPanelMaxVectors with at most as many pending columns: folds
  // them into P_base and sets Vt = U P_base in one pass over the upper
  // triangle (the fused sweep); no pending columns remain.
  void SweepVt(const float* u, int64_t ldu, int64_t k);
  // Copies the upper triangle onto the stale lower one (blocks strictly
  // below the diagonal blocks only).
  void MirrorLower();
  // Gives P_base its own buffer when a SharedP() holder still reads it.
  void UnshareP();

  Eigen::VectorXd theta_;
  std::shared_ptr<SymMatrix> p_;
  // SharedP() pointers to p_ still held. Each holder's release is a
  // release-order decrement that UnshareP reads with acquire, so the
  // holder's reads of P happen before the next fold writes it
  // (shared_ptr::use_count() is a relaxed load and would not order them).
  std::shared_ptr<std::atomic<int64_t>> p_leases_ =
      std::make_shared<std::atomic<int64_t>>(0);
  // After a fold: P_base's blocks below the diagonal blocks are stale.
  bool lower_stale_ = false;
  RlsOptions options_;
  // Pending columns of W, stored as rows of length p_.ld() (row-major
  // fold_columns x ld), so the fold is one SYRK.
  std::unique_ptr<float[], void (*)(float*)> w_;
  int64_t pending_ = 0;
  int64_t updates_ = 0;
  const internal::Kernels* kernels_ = nullptr;
  // Batches wider than 8 and the fold through OpenBLAS (large_batches).
  bool blas_large_ = false;
  int threads_ = 1;
  RlsPhaseSeconds phases_;
  // V' of the batch in flight: fold_columns x ld floats.
  std::unique_ptr<float[], void (*)(float*)> vt_;
  // The fused sweep's buffers (allocated on its first use): U padded
  // (kPanelMaxVectors x ld, from an offset chosen against W's: SweepVt),
  // the row dots D (n x kPanelMaxVectors) and the transposed sums T of
  // each of kSweepGroups fixed groups of row blocks.
  static constexpr int kSweepGroups = 8;
  // Extra floats of sweep_u_, so that U can start at a chosen offset.
  static constexpr int64_t kSweepUSlack = 1024;
  std::unique_ptr<float[], void (*)(float*)> sweep_u_;
  std::unique_ptr<float[], void (*)(float*)> sweep_d_;
  std::unique_ptr<float[], void (*)(float*)> sweep_t_;
  // The pending columns packed for the blocked fold (fold_columns x ld
  // floats, allocated on the first blocked fold): packed once per fold
  // instead of once per row block.
  std::unique_ptr<float[], void (*)(float*)> w_packed_{nullptr, nullptr};
};

}  // namespace leap::readout

#endif  // LEAP_READOUT_RLS_H_
