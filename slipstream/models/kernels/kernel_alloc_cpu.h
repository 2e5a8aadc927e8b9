/* Scratch memory of the compiled CPU kernels, and their return codes (included by every kernel
 * source; cpu_kernels.py hashes it with them). Every allocation goes through sq_malloc / sq_calloc
 * and is checked: a kernel that cannot get its scratch frees what it got, computes nothing and
 * returns SQ_ENOMEM, which cpu_kernels.check_rc raises as MemoryError (tests/test_quant_kernels.py
 * scans the sources for any other allocation). sq_fail_allocs(n) makes the n-th allocation from now
 * fail (0: none), so the tests can take every such path.
 */
#ifndef SQ_KERNEL_ALLOC_CPU_H
#define SQ_KERNEL_ALLOC_CPU_H
#include <stdint.h>
#include <stdlib.h>

#define SQ_OK 0
#define SQ_EINVAL (-1) /* a shape or group size the kernel does not handle */
#define SQ_ENOMEM (-2) /* its scratch memory could not be allocated */

/* weak: one countdown for the library, whichever of the sources it was built from */
__attribute__((weak)) int64_t sq_alloc_countdown = 0;

__attribute__((weak)) void sq_fail_allocs(int64_t n) { __atomic_store_n(&sq_alloc_countdown, n, __ATOMIC_SEQ_CST); }

static inline int sq_forced_failure(void) {
    if (__atomic_load_n(&sq_alloc_countdown, __ATOMIC_RELAXED) <= 0) return 0;
    return __atomic_sub_fetch(&sq_alloc_countdown, 1, __ATOMIC_SEQ_CST) == 0;
}

/* (malloc(0) may return NULL: a zero-row call must not read as out of memory) */
static inline void *sq_malloc(size_t n) { return sq_forced_failure() ? NULL : malloc(n ? n : 1); }

static inline void *sq_calloc(size_t n, size_t size) {
    return sq_forced_failure() ? NULL : calloc(n ? n : 1, size ? size : 1);
}
#endif
