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

/* Each C[m, n] is one dot product in a fixed order (8 lanes over k, FMA where
   the CPU has it, a fixed tree, then the tail in order), whatever M, the
   blocking or the thread split: a row's result does not depend on how many
   rows came with it (a verify row equals the 1-token step's). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
#define MB 16
/* in a register: one load per value, not one per use (GCC reloads otherwise) */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__)
#define REG(v) __asm__("" : "+x"(v))
#else
#define REG(v) (void)0
#endif
static inline v8 ld(const float* p) { return *(const v8*)p; }  /* v8 is aligned(4): an unaligned load */
static inline float hsum(v8 v) {
  v4 a, b; memcpy(&a, &v, 16); memcpy(&b, (char*)&v + 16, 16); a += b;
  return (a[0] + a[2]) + (a[1] + a[3]);
}
static inline void put(float* c, float r, float alpha, float beta) {
  *c = alpha * r + (beta != 0 ? beta * *c : 0);  /* beta = 0: C may hold garbage */
}

/* The kernel: rows [i, i + MR) of A against rows b[0..NB) of B [N, K], over
   k in [k0, k1), accumulators kept in part[MR][NB] between k-chunks (a stored
   and reloaded vector: the order of the sums is unchanged). A comes packed as
   Ap[K / 8][M][8], so one pointer walks it. MR * NB accumulators, NB weights
   and one x fit AVX2's 16 registers (MR, NB constants: the loops unroll); each
   weight is loaded once for the MR rows. pf (first group only): the next
   block's rows, fetched while this block computes (5-10% at 8-16 rows here;
   1-2 rows stream well without it). */
#define U _Pragma("GCC unroll 8")
#define STEP(k, q, MR, NB)                                                               \
  { v8 w[NB];                                                                            \
    U for (int j = 0; j < NB; j++) { w[j] = ld(b[j] + (k)); REG(w[j]); }                 \
    U for (int i = 0; i < MR; i++) {                                                     \
      v8 x = ld((q) + i * 8); REG(x);                                                    \
      U for (int j = 0; j < NB; j++) acc[i][j] += x * w[j];                              \
    } }
#define BLK(MR, NB)                                                                      \
static inline __attribute__((always_inline)) void blk_##MR##_##NB(                       \
    const float* const* b, const float* p, size_t ms, I k, I k1, v8* part, int first,    \
    const float* const* pf) {                                                            \
  v8 acc[MR][NB];                                                                        \
  U for (int i = 0; i < MR; i++) U for (int j = 0; j < NB; j++)                          \
    acc[i][j] = first ? (v8){0} : part[i * NB + j];                                      \
  for (; k + 16 <= k1; k += 16, p += 2 * ms) {  /* one cache line of each row */         \
    if (pf) U for (int j = 0; j < 3; j++) __builtin_prefetch(pf[j] + k);                 \
    STEP(k, p, MR, NB) STEP(k + 8, p + ms, MR, NB)                                       \
  }                                                                                      \
  if (k < k1) STEP(k, p, MR, NB)                                                         \
  U for (int i = 0; i < MR; i++) U for (int j = 0; j < NB; j++) part[i * NB + j] = acc[i][j]; \
}
BLK(1, 8) BLK(2, 4) BLK(3, 3) BLK(2, 3) BLK(1, 3)

/* Columns [n0, n1) of an M-row product, NB rows of B at a time: 1 or 2 rows of
   A in one group; more in groups of 3 over the same rows of B (3 x 3: ~70
   GFLOP/s a core from L1 here; 4 x 3 spills to 40; 2 + 2 for 4 rows: no gain), k cut in chunks
   so that those rows and A's chunk stay in L1 from one group to the next. */
#define KC 128  /* 3 rows of B + 16 of A per chunk: 10 KB (128: 5-10% faster than 256, measured) */
#define NT(NAME, NB, GROUPS)                                                             \
static void NAME(I M, I n0, I n1, I K, float alpha, const float* Ap, const float* A,     \
                 I lda, const float* B, I ldb, float beta, float* C, I ldc) {            \
  I K8 = K & ~7, kc = M <= 2 ? K8 : KC;                                                  \
  v8 part[MB * NB];                                                                      \
  for (I n = n0; n < n1; n += NB) {                                                      \
    int nb = n1 - n < NB ? n1 - n : NB;                                                  \
    const float* b[NB], *pf[3];                                                          \
    for (int j = 0; j < NB; j++) b[j] = B + (size_t)(n + (j < nb ? j : 0)) * ldb;        \
    for (int j = 0; j < 3; j++) pf[j] = n + NB + j < n1 ? b[0] + (size_t)(NB + j) * ldb : b[0]; \
    for (I k0 = 0, k1 = 0, once = 1; once || k1 < K8; k0 = k1, once = 0) { /* K < 8: once */ \
      k1 = k0 + kc < K8 ? k0 + kc : K8;                                                  \
      const float* p = Ap + (size_t)k0 * M;                                              \
      size_t ms = (size_t)M * 8;                                                         \
      GROUPS                                                                             \
    }                                                                                    \
    for (I i = 0; i < M; i++) {                                                          \
      const float* x = A + (size_t)i * lda;                                              \
      for (int j = 0; j < nb; j++) {                                                     \
        float r = hsum(part[i * NB + j]);                                                \
        for (I t = K8; t < K; t++) r += x[t] * b[j][t];                                  \
        put(C + (size_t)i * ldc + n + j, r, alpha, beta);                                \
      }                                                                                  \
    }                                                                                    \
  }                                                                                      \
}
NT(nt_1, 8, blk_1_8(b, p, ms, k0, k1, part, k0 == 0, 0);)
NT(nt_2, 4, blk_2_4(b, p, ms, k0, k1, part, k0 == 0, 0);)
NT(nt_g, 3, {
  I i = 0;
  for (; i + 3 <= M; i += 3) blk_3_3(b, p + i * 8, ms, k0, k1, part + i * 3, k0 == 0, i ? 0 : pf);
  if (M - i == 2) blk_2_3(b, p + i * 8, ms, k0, k1, part + i * 3, k0 == 0, 0);
  if (M - i == 1) blk_1_3(b, p + i * 8, ms, k0, k1, part + i * 3, k0 == 0, 0);
})
typedef void (*nt_fn)(I, I, I, I, float, const float*, const float*, I, const float*, I, float, float*, I);
static nt_fn nt_for(I M) { return M == 1 ? nt_1 : M == 2 ? nt_2 : nt_g; }

/* A [M, K] -> Ap [K / 8][M][8], in a per-thread buffer kept between calls. */
#include <stdlib.h>
static __thread float* pack_buf = 0;
static __thread size_t pack_cap = 0;
static const float* pack(I M, I K, const float* A, I lda) {
  size_t need = (size_t)(K & ~7) * M + 16;
  if (need > pack_cap) {
    free(pack_buf);
    pack_buf = aligned_alloc(64, ((need * 4 + 63) / 64) * 64);
    pack_cap = pack_buf ? need : 0;
    if (!pack_buf) return 0;
  }
  float* p = pack_buf;
  for (I k = 0; k + 8 <= K; k += 8)
    for (I i = 0; i < M; i++, p += 8) memcpy(p, A + (size_t)i * lda + k, 32);
  return pack_buf;
}

/* C = alpha A B + beta C with B [K, N] row-major (attention's probs @ V): MR
   rows (a constant: registers, not memory) by 16 columns at a time, up to 6
   rows (12 accumulators). Each C[m, n] sums k in order. */
#define NN(MR)                                                                           \
static void nn_##MR(I n, I K, const float* A, I lda, const float* B, I ldb, v8 acc[][2]) { \
  v8 s[MR][2];                                                                           \
  U for (int i = 0; i < MR; i++) s[i][0] = s[i][1] = (v8){0};                            \
  for (I k = 0; k < K; k++) {                                                            \
    const float* r = B + (size_t)k * ldb + n;                                            \
    v8 w0 = ld(r), w1 = ld(r + 8);                                                       \
    REG(w0); REG(w1);                                                                    \
    U for (int i = 0; i < MR; i++) {                                                     \
      float a = A[(size_t)i * lda + k];                                                  \
      v8 x = {a, a, a, a, a, a, a, a};                                                   \
      s[i][0] += x * w0; s[i][1] += x * w1;                                              \
    }                                                                                    \
  }                                                                                      \
  U for (int i = 0; i < MR; i++) { acc[i][0] = s[i][0]; acc[i][1] = s[i][1]; }           \
}
NN(1) NN(2) NN(3) NN(4) NN(5) NN(6)
typedef void (*nn_fn)(I, I, const float*, I, const float*, I, v8[][2]);
static const nn_fn NN_FN[7] = {0, nn_1, nn_2, nn_3, nn_4, nn_5, nn_6};
static void small_sgemm_nn(I M, I N, I K, float alpha, const float* A, I lda,
                           const float* B, I ldb, float beta, float* C, I ldc) {
  v8 acc[6][2];
  for (I i0 = 0; i0 < M; i0 += 6) {
    I mr = M - i0 < 6 ? M - i0 : 6;
    const float* a = A + (size_t)i0 * lda;
    float* c = C + (size_t)i0 * ldc;
    I n = 0;
    for (; n + 16 <= N; n += 16) {
      NN_FN[mr](n, K, a, lda, B, ldb, acc);
      for (I i = 0; i < mr; i++)
        for (int j = 0; j < 16; j++) put(c + (size_t)i * ldc + n + j, acc[i][j / 8][j % 8], alpha, beta);
    }
    for (; n < N; n++)
      for (I i = 0; i < mr; i++) {
        float r = 0;
        for (I k = 0; k < K; k++) r += a[(size_t)i * lda + k] * B[(size_t)k * ldb + n];
        put(c + (size_t)i * ldc + n, r, alpha, beta);
      }
  }
}

/* Threads: a small pool that sleeps on a condition variable between calls (it
   never spins: spinning threads stall when another process holds a core), and
   takes chunks of W's rows from a shared counter, so a thread that is
   descheduled delays the product by one chunk, not by half of it. */
int mlx_dflash_threads = 1;
/* Size classes of W (N * K): the kernel's routing and its threads are chosen per
   row count and class, measured on this machine (fastblas.calibrate). */
#define NCLS 7
long mlx_dflash_class_max[NCLS] = {16384, 65536, 262144, 1048576, 4194304, 16777216, -1};
static int size_class(I n, I k) {
  long nk = (long)n * k;
  int c = 0;
  while (c < NCLS - 1 && nk > mlx_dflash_class_max[c]) c++;
  return c;
}
unsigned char mlx_dflash_kthreads[MB + 1][NCLS];  /* per row count and class; 0: mlx_dflash_threads */
#define MAXT 64
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER, job_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_work = PTHREAD_COND_INITIALIZER, cv_done = PTHREAD_COND_INITIALIZER;
static int nworkers = 0, busy = 0;
static long gen = 0;
static struct { nt_fn f; I M, N, K, lda, ldb, ldc, chunk, nchunks; float alpha, beta;
                const float *Ap, *A, *B; float* C; atomic_int next, done; } J;

static void run_chunks(void) {
  int c;
  while ((c = atomic_fetch_add(&J.next, 1)) < J.nchunks) {
    I n0 = c * J.chunk, n1 = n0 + J.chunk < J.N ? n0 + J.chunk : J.N;
    J.f(J.M, n0, n1, J.K, J.alpha, J.Ap, J.A, J.lda, J.B, J.ldb, J.beta, J.C, J.ldc);
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
  nt_fn f = nt_for(M);
  const float* Ap = pack(M, K, A, lda);
  if (!Ap) return 0;  /* out of memory: OpenBLAS does it */
  int t = mlx_dflash_kthreads[M][size_class(N, K)];
  t = t ? t : mlx_dflash_threads;
  t = t < MAXT ? t : MAXT;
  /* threads only where the work dwarfs a wake-up (~10 us), and one caller at a time */
  if (t <= 1 || (long)N * K < (1L << 19) || pthread_mutex_trylock(&job_mu) != 0) {
    f(M, 0, N, K, alpha, Ap, A, lda, B, ldb, beta, C, ldc);
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
  I chunk = (N / (8 * t) + 23) / 24 * 24;  /* a multiple of every NB */
  J.f = f; J.M = M; J.N = N; J.K = K; J.lda = lda; J.ldb = ldb; J.ldc = ldc; J.alpha = alpha; J.beta = beta;
  J.Ap = Ap; J.A = A; J.B = B; J.C = C; J.chunk = chunk < 24 ? 24 : chunk;
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
unsigned char mlx_dflash_route[MB + 1][NCLS];

static int routed(I m, I n, I k) {
  return mlx_dflash_small_gemm == 2 || mlx_dflash_route[m][size_class(n, k)];
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
      small_sgemm_nn(m, n, k, al, a, lda, b, ldb, be, c, ldc);  /* attention-sized only */
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
    kernel this CPU's FMA and registers (AVX2 here: 2.5x the generic SSE2
    build); a compiler without it builds generic vectors."""
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
