#include "parallel.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace mlx_h2o {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One parallel_for call. Lives on the caller's stack; the caller returns only when every task ran
// and no worker still holds a pointer to it.
struct Job {
  ParallelTask task;
  void* context;
  int n;
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  std::atomic<int> users{0};

  void drain() {
    int finished = 0;
    for (int i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed)) {
      task(context, i);
      ++finished;
    }
    if (finished) done.fetch_add(finished, std::memory_order_acq_rel);
  }
};

class ThreadPool {
 public:
  explicit ThreadPool(int workers) {
    for (int i = 0; i < workers; ++i) std::thread([this] { work_loop(); }).detach();  // lives as long as the process
    workers_ = workers;
  }

  int workers() const { return workers_; }

  // Returns false (and runs nothing) when another caller holds the pool: two MLX streams may run
  // kernels at once, and a task must never wait on its own pool.
  bool try_run(int n, ParallelTask task, void* context) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    Job job;
    job.task = task;
    job.context = context;
    job.n = n;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_.store(&job, std::memory_order_release);
      generation_.fetch_add(1, std::memory_order_acq_rel);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    job.drain();
    wait_for([&] { return job.done.load(std::memory_order_acquire) == n; });
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_.store(nullptr, std::memory_order_release);
    }
    wait_for([&] { return job.users.load(std::memory_order_acquire) == 0; });
    return true;
  }

 private:
  // Spin briefly for what the caller waits on (the last tasks that workers are running), then sleep
  // until a worker leaves the job: a worker preempted by another thread on its core (with two cores,
  // mlx-lm's Python thread building the next step's graph) can hold a task for a whole time slice,
  // and a caller spinning meanwhile would keep the other core from running either of them.
  template <class Ready>
  void wait_for(Ready ready) {
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
    while (!ready() && std::chrono::steady_clock::now() < spin_until)
      for (int i = 0; i < 16; ++i) cpu_relax();
    if (ready()) return;
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, ready);
  }

  // Join the current job, if any, and help until its tasks run out.
  void help() {
    Job* job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job = job_.load(std::memory_order_acquire);
      if (!job) return;
      job->users.fetch_add(1, std::memory_order_acq_rel);
    }
    job->drain();
    // Leaving under the lock (the job may be gone right after), then waking a caller asleep in
    // wait_for: it checks its condition under the same lock, so the wake cannot fall between its
    // check and its wait. Every task a worker finishes is followed by this, so a caller waiting for
    // the last task is woken too. No waiter: no system call.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job->users.fetch_sub(1, std::memory_order_acq_rel);
    }
    finished_.notify_all();
  }

  void work_loop() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "mlx_h2o pool");  // 15 characters at most
#endif
    unsigned long seen = generation_.load();
    for (;;) {
      // Spin a while before sleeping: kernels come in bursts (phases of one call, the layers of one
      // decode step), and waking a sleeping thread costs the caller a system call and tens of
      // microseconds. Politely: each round yields the core to any other runnable thread (mlx-lm's
      // Python thread building the next step's graph), which a plain spin would slow down.
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < spin_until) {
        for (int i = 0; i < 64; ++i) cpu_relax();
        sched_yield();
      }
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      }
      seen = generation_.load(std::memory_order_acquire);
      help();
    }
  }

  int workers_ = 0;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;      // workers wait here for a job
  std::condition_variable finished_;  // a caller waits here for its job's last tasks
  std::atomic<unsigned long> generation_{0};
  std::atomic<Job*> job_{nullptr};
  std::atomic<int> sleepers_{0};
};

ThreadPool* pool_instance = nullptr;

// Never destroyed: worker threads may still be parked at exit. A forked child has no workers, so
// it forgets the parent's pool and builds its own on first use.
ThreadPool& pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork(nullptr, nullptr, [] { pool_instance = nullptr; });
  });
  static std::mutex create_mutex;
  std::lock_guard<std::mutex> lock(create_mutex);
  if (!pool_instance) pool_instance = new ThreadPool(std::max(0, kernel_threads() - 1));
  return *pool_instance;
}

}  // namespace

int kernel_threads() {
  static const int threads = [] {
    if (const char* env = std::getenv("MLX_H2O_NUM_THREADS")) {
      int v = std::atoi(env);
      if (v >= 1) return v;
    }
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return threads;
}

void parallel_for(int n, int threads, ParallelTask task, void* context) {
  if (n <= 0) return;
  if (threads > 1 && n > 1 && pool().workers() > 0 && pool().try_run(n, task, context)) return;
  for (int i = 0; i < n; ++i) task(context, i);
}

}  // namespace mlx_h2o
