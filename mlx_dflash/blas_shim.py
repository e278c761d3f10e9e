"""The C source of the BLAS shim and its build (see fastblas.py for why).

Built once per OpenBLAS location, compiler flags and CPU, into the cache
directory, under a file lock: concurrent first starts wait for one build
instead of loading a half-written library."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

SOURCE = r"""
/* mlx-dflash BLAS shim: forward mlx's cblas gemm calls to scipy-openblas32,
   except few-row float products x @ W.T (a verify forward of w <= 16 tokens)
   where this machine measured the kernel below faster: OpenBLAS repacks W on
   every call, and its m = 1 path (gemv) is slow on wide outputs. */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
typedef int I;
#define GEMM(T, name) \
  extern void scipy_cblas_##name(I, I, I, I, I, I, T, const void*, I, const void*, I, T, void*, I);
GEMM(float, sgemm)
GEMM(double, dgemm)
GEMM(const void*, cgemm)
void cblas_dgemm(I o, I ta, I tb, I m, I n, I k, double al, const void* a, I lda,
                 const void* b, I ldb, double be, void* c, I ldc)
{ scipy_cblas_dgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc); }
void cblas_cgemm(I o, I ta, I tb, I m, I n, I k, const void* al, const void* a, I lda,
                 const void* b, I ldb, const void* be, void* c, I ldc)
{ scipy_cblas_cgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc); }

/* Each C[m, n] is one dot product in a fixed order (16 lanes over k, a tree,
   the tail), whatever M, the blocking or the thread split: a row's result does
   not depend on how many rows came with it. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
#define MB 16
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }
static inline float hsum(v16 v) {
  v8 a, b; memcpy(&a, &v, 32); memcpy(&b, (char*)&v + 32, 32); a += b;
  v4 c, d; memcpy(&c, &a, 16); memcpy(&d, (char*)&a + 16, 16); c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}
static inline void put(float* c, float r, float alpha, float beta) {
  *c = alpha * r + (beta != 0 ? beta * *c : 0);  /* beta = 0: C may hold garbage */
}

/* One block of C = alpha A B^T + beta C: rows [i0, i0 + MR) of A against rows
   [n, n + nb) of B [N, K] row-major. A comes packed as Ap[K / 16][M][16] (one
   pointer walks it: no register per row), the tail k >= K16 from A itself.
   MR * NB accumulators, NB weights and one x stay in registers (MR and NB are
   constants: the loops unroll); each weight is loaded once for the MR rows. */
#define BLK(MR, NB)                                                                      \
static inline __attribute__((always_inline)) void blk_##MR##_##NB(                       \
    I n, int nb, I M, I i0, I K, float alpha, const float* Ap, const float* A, I lda,    \
    const float* B, I ldb, float beta, float* C, I ldc) {                                \
  I K16 = K & ~15;                                                                       \
  const float* b[NB];                                                                    \
  for (int j = 0; j < NB; j++) b[j] = B + (size_t)(n + (j < nb ? j : 0)) * ldb;          \
  v16 acc[MR][NB];                                                                       \
  for (int i = 0; i < MR; i++) for (int j = 0; j < NB; j++) acc[i][j] = (v16){0};        \
  const float* p = Ap + (size_t)i0 * 16;                                                 \
  for (I k = 0; k < K16; k += 16, p += (size_t)M * 16) {                                 \
    v16 w[NB];                                                                           \
    for (int j = 0; j < NB; j++) {  /* 1 KB ahead: ~15% at 16 rows, measured */          \
      w[j] = ld(b[j] + k);                                                               \
      __builtin_prefetch(b[j] + k + 256);                                                \
    }                                                                                    \
    for (int i = 0; i < MR; i++) {                                                       \
      v16 x = ld(p + i * 16);                                                            \
      __asm__("" : "+v"(x));  /* one load per x, not one per use */                      \
      for (int j = 0; j < NB; j++) acc[i][j] += x * w[j];                                \
    }                                                                                    \
  }                                                                                      \
  for (int i = 0; i < MR; i++) {                                                         \
    const float* x = A + (size_t)(i0 + i) * lda;                                         \
    for (int j = 0; j < nb; j++) {                                                       \
      float r = hsum(acc[i][j]);                                                         \
      for (I k = K16; k < K; k++) r += x[k] * b[j][k];                                   \
      put(C + (size_t)(i0 + i) * ldc + n + j, r, alpha, beta);                           \
    }                                                                                    \
  }                                                                                      \
}
BLK(1, 8) BLK(2, 8) BLK(3, 6) BLK(4, 5) BLK(5, 4) BLK(6, 4) BLK(7, 3) BLK(8, 3)

/* Columns [n0, n1) of an M-row product: M <= 8 in one group; 9..16 rows as two
   groups over the same NB rows of B, which are still in L1 for the second. */
#define NT1(M, NB)                                                                       \
static void nt_##M(I n0, I n1, I K, float alpha, const float* Ap, const float* A, I lda, \
                   const float* B, I ldb, float beta, float* C, I ldc) {                 \
  for (I n = n0; n < n1; n += NB) {                                                      \
    int nb = n1 - n < NB ? n1 - n : NB;                                                  \
    blk_##M##_##NB(n, nb, M, 0, K, alpha, Ap, A, lda, B, ldb, beta, C, ldc);            \
  }                                                                                      \
}
#define NT2(M, R)                                                                        \
static void nt_##M(I n0, I n1, I K, float alpha, const float* Ap, const float* A, I lda, \
                   const float* B, I ldb, float beta, float* C, I ldc) {                 \
  for (I n = n0; n < n1; n += 3) {                                                       \
    int nb = n1 - n < 3 ? n1 - n : 3;                                                    \
    blk_8_3(n, nb, M, 0, K, alpha, Ap, A, lda, B, ldb, beta, C, ldc);                    \
    blk_##R(n, nb, M, 8, K, alpha, Ap, A, lda, B, ldb, beta, C, ldc);                    \
  }                                                                                      \
}
BLK(1, 3) BLK(2, 3) BLK(3, 3) BLK(4, 3) BLK(5, 3) BLK(6, 3)
NT1(1, 8) NT1(2, 8) NT1(3, 6) NT1(4, 5) NT1(5, 4) NT1(6, 4) NT1(7, 3) NT1(8, 3)
NT2(9, 1_3) NT2(10, 2_3) NT2(11, 3_3) NT2(12, 4_3) NT2(13, 5_3) NT2(14, 6_3) NT2(15, 7_3) NT2(16, 8_3)
typedef void (*nt_fn)(I, I, I, float, const float*, const float*, I, const float*, I, float, float*, I);
static const nt_fn NT_FN[MB + 1] = {0, nt_1, nt_2, nt_3, nt_4, nt_5, nt_6, nt_7, nt_8,
                                    nt_9, nt_10, nt_11, nt_12, nt_13, nt_14, nt_15, nt_16};

/* A [M, K] -> Ap [K / 16][M][16], in a per-thread buffer kept between calls. */
#include <stdlib.h>
static __thread float* pack_buf = 0;
static __thread size_t pack_cap = 0;
static const float* pack(I M, I K, const float* A, I lda) {
  size_t need = (size_t)(K & ~15) * M + 16;
  if (need > pack_cap) {
    free(pack_buf);
    pack_buf = aligned_alloc(64, ((need * 4 + 63) / 64) * 64);
    pack_cap = pack_buf ? need : 0;
    if (!pack_buf) return 0;
  }
  float* p = pack_buf;
  for (I k = 0; k + 16 <= K; k += 16)
    for (I i = 0; i < M; i++, p += 16) memcpy(p, A + (size_t)i * lda + k, 64);
  return pack_buf;
}

/* C = alpha A B + beta C with B [K, N] row-major (attention's probs @ V), up to
   8 rows at a time. Each C[m, n] sums k in order. */
static void small_sgemm_nn(I M, I N, I K, float alpha, const float* A, I lda,
                           const float* B, I ldb, float beta, float* C, I ldc) {
  I n = 0;
  for (; n + 32 <= N; n += 32) {
    v16 acc0[8], acc1[8];
    for (int i = 0; i < 8; i++) { acc0[i] = (v16){0}; acc1[i] = (v16){0}; }
    for (I k = 0; k < K; k++) {
      v16 w0 = ld(B + (size_t)k * ldb + n), w1 = ld(B + (size_t)k * ldb + n + 16);
      for (int i = 0; i < 8; i++)
        if (i < M) { float x = A[(size_t)i * lda + k]; acc0[i] += x * w0; acc1[i] += x * w1; }
    }
    for (I i = 0; i < M; i++)
      for (int j = 0; j < 16; j++) {
        put(C + (size_t)i * ldc + n + j, acc0[i][j], alpha, beta);
        put(C + (size_t)i * ldc + n + 16 + j, acc1[i][j], alpha, beta);
      }
  }
  for (; n < N; n++)
    for (I i = 0; i < M; i++) {
      float r = 0;
      for (I k = 0; k < K; k++) r += A[(size_t)i * lda + k] * B[(size_t)k * ldb + n];
      put(C + (size_t)i * ldc + n, r, alpha, beta);
    }
}

/* Threads: a small pool that sleeps on a condition variable between calls (it
   never spins: spinning threads stall when another process holds a core), and
   takes chunks of W's rows from a shared counter, so a thread that is
   descheduled delays the product by one chunk, not by half of it. */
int mlx_dflash_threads = 1;
#define MAXT 64
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER, job_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_work = PTHREAD_COND_INITIALIZER, cv_done = PTHREAD_COND_INITIALIZER;
static int nworkers = 0, busy = 0;
static long gen = 0;
static struct { nt_fn f; I N, K, lda, ldb, ldc, chunk, nchunks; float alpha, beta;
                const float *Ap, *A, *B; float* C; atomic_int next, done; } J;

static void run_chunks(void) {
  int c;
  while ((c = atomic_fetch_add(&J.next, 1)) < J.nchunks) {
    I n0 = c * J.chunk, n1 = n0 + J.chunk < J.N ? n0 + J.chunk : J.N;
    J.f(n0, n1, J.K, J.alpha, J.Ap, J.A, J.lda, J.B, J.ldb, J.beta, J.C, J.ldc);
    atomic_fetch_add(&J.done, 1);
  }
}
static void* worker(void* arg) {
  long seen = (long)arg;
  pthread_mutex_lock(&mu);
  for (;;) {
    while (gen == seen) pthread_cond_wait(&cv_work, &mu);
    seen = gen;
    busy++;
    pthread_mutex_unlock(&mu);
    run_chunks();
    pthread_mutex_lock(&mu);
    if (--busy == 0) pthread_cond_broadcast(&cv_done);
  }
  return 0;
}
static void after_fork_child(void) {  /* the pool does not survive fork() */
  pthread_mutex_init(&mu, 0); pthread_mutex_init(&job_mu, 0);
  pthread_cond_init(&cv_work, 0); pthread_cond_init(&cv_done, 0);
  nworkers = 0; busy = 0;
}

static int nt(I M, I N, I K, float alpha, const float* A, I lda, const float* B, I ldb,
               float beta, float* C, I ldc) {
  nt_fn f = NT_FN[M];
  const float* Ap = pack(M, K, A, lda);
  if (!Ap) return 0;  /* out of memory: OpenBLAS does it */
  int t = mlx_dflash_threads < MAXT ? mlx_dflash_threads : MAXT;
  /* threads only where the work dwarfs a wake-up (~10 us), and one caller at a time */
  if (t <= 1 || (long)N * K < (1L << 19) || pthread_mutex_trylock(&job_mu) != 0) {
    f(0, N, K, alpha, Ap, A, lda, B, ldb, beta, C, ldc);
    return 1;
  }
  pthread_mutex_lock(&mu);
  static int atfork = 0;
  if (!atfork) { pthread_atfork(0, 0, after_fork_child); atfork = 1; }
  while (nworkers < t - 1) {
    pthread_t th;
    if (pthread_create(&th, 0, worker, (void*)gen) != 0) break;
    pthread_detach(th);
    nworkers++;
  }
  while (busy > 0) pthread_cond_wait(&cv_done, &mu);  /* late wakers of the last job */
  I chunk = (N / (8 * t) + 15) & ~15;
  J.f = f; J.N = N; J.K = K; J.lda = lda; J.ldb = ldb; J.ldc = ldc; J.alpha = alpha; J.beta = beta;
  J.Ap = Ap; J.A = A; J.B = B; J.C = C; J.chunk = chunk < 16 ? 16 : chunk;
  J.nchunks = (N + J.chunk - 1) / J.chunk;
  atomic_store(&J.next, 0); atomic_store(&J.done, 0);
  gen++;
  pthread_cond_broadcast(&cv_work);
  pthread_mutex_unlock(&mu);
  run_chunks();
  pthread_mutex_lock(&mu);
  while (atomic_load(&J.done) < J.nchunks || busy > 0) pthread_cond_wait(&cv_done, &mu);
  pthread_mutex_unlock(&mu);
  pthread_mutex_unlock(&job_mu);
  return 1;
}

/* Routing: 0 = all to OpenBLAS, 1 = where this machine measured the kernel
   faster (route[m][size class of W], set by fastblas.calibrate), 2 = every
   shape the kernel takes (tests, A/B runs). */
int mlx_dflash_small_gemm = 0;
long mlx_dflash_small_gemm_calls = 0;
#define NCLS 6
long mlx_dflash_class_max[NCLS] = {16384, 65536, 262144, 1048576, 4194304, -1};  /* N * K */
unsigned char mlx_dflash_route[MB + 1][NCLS];

static int routed(I m, I n, I k) {
  if (mlx_dflash_small_gemm == 2) return 1;
  long nk = (long)n * k;
  int c = 0;
  while (c < NCLS - 1 && nk > mlx_dflash_class_max[c]) c++;
  return mlx_dflash_route[m][c];
}

void cblas_sgemm(I o, I ta, I tb, I m, I n, I k, float al, const void* a, I lda,
                 const void* b, I ldb, float be, void* c, I ldc) {
  /* 101 RowMajor, 111 NoTrans, 112 Trans */
  if (mlx_dflash_small_gemm && o == 101 && ta == 111 && m >= 1 && m <= MB && n > 0 && k > 0) {
    if (tb == 112 && routed(m, n, k) && nt(m, n, k, al, a, lda, b, ldb, be, c, ldc)) {
      __atomic_fetch_add(&mlx_dflash_small_gemm_calls, 1, __ATOMIC_RELAXED);
      return;
    }
    if (tb == 111 && (long)n * k <= 65536) {
      __atomic_fetch_add(&mlx_dflash_small_gemm_calls, 1, __ATOMIC_RELAXED);
      for (I i = 0; i < m; i += 8)  /* attention-sized only: W @ x is rare */
        small_sgemm_nn(m - i < 8 ? m - i : 8, n, k, al, (const float*)a + (size_t)i * lda, lda,
                       b, ldb, be, (float*)c + (size_t)i * ldc, ldc);
      return;
    }
  }
  scipy_cblas_sgemm(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}
"""


def cache_dir() -> Path:
    """Where the shim and its measurements live: $MLX_DFLASH_BLAS_DIR, else the
    user cache dir. Not under $MLX_DFLASH_HOME: they belong to the machine, not
    to a user's settings (and a fresh home must not rebuild and re-measure)."""
    if os.environ.get("MLX_DFLASH_BLAS_DIR"):
        return Path(os.environ["MLX_DFLASH_BLAS_DIR"])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mlx-dflash")) / "blas"


def cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    model = next((l for l in info.splitlines() if l.startswith("model name")), "")
    flags = next((l for l in info.splitlines() if l.startswith(("flags", "Features"))), "")
    return model + flags


def shim_key(lib: Path) -> str:
    return hashlib.sha1((SOURCE + str(lib) + cpu_id()).encode()).hexdigest()[:12]


def build(lib: Path, timeout: float = 300) -> Path:
    """The compiled shim for OpenBLAS `lib` (cached). -march=native gives the
    kernel this CPU's vector width (AVX-512 here, NEON on arm)."""
    from filelock import FileLock

    out = cache_dir() / f"libmlx_dflash_blas-{shim_key(lib)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock", timeout=timeout):
        if out.exists():  # another process built it while this one waited
            return out
        src = out.with_suffix(f".{os.getpid()}.c")
        src.write_text(SOURCE)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cc = os.environ.get("CC", "cc")
        cmd = [cc, "-O3", "-shared", "-fPIC", "-pthread", str(src), "-o", str(tmp), f"-L{lib.parent}",
               f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}"]
        try:
            try:
                subprocess.run(cmd[:2] + ["-march=native"] + cmd[2:], check=True, capture_output=True)
            except subprocess.CalledProcessError:  # a compiler without -march=native: generic vectors
                subprocess.run(cmd, check=True, capture_output=True)
            os.replace(tmp, out)  # atomic, and under the lock
        finally:
            for p in (src, tmp):
                p.unlink(missing_ok=True)
    return out
