// A small persistent thread pool for the CPU kernels.
//
// MLX runs each CPU primitive on its stream's single worker thread; a kernel that wants the other
// cores asks this pool. The calling thread takes part, so `threads` counts it. The interface is a
// plain function pointer so that code compiled for another instruction set (kernels/*_impl.h) can
// call it without instantiating any shared template.
#pragma once

namespace mlx_h2o {

using ParallelTask = void (*)(void* context, int index);

/** Threads the kernels use: MLX_H2O_NUM_THREADS if set (>= 1), else the hardware's count. */
int kernel_threads();

/** Run task(context, i) for i in [0, n) on up to `threads` threads (dynamic scheduling) and wait.
 *  Runs serially when threads <= 1, n <= 1, or another thread is already using the pool. */
void parallel_for(int n, int threads, ParallelTask task, void* context);

}  // namespace mlx_h2o
