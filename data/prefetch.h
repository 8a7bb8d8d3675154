#pragma once
// OrderedPrefetch<T>: items 0..n-1 built by `workers` threads ahead of one consumer, delivered
// in index order through a ring of `capacity` slots (a bounded queue: a worker waits while the
// item it would build is `capacity` or more ahead of the consumer).
//
// With workers == 0, next() builds each item on the consumer's thread. An exception thrown while
// building item k reaches the consumer from next() after items 0..k-1; no later item is then
// started. The destructor stops and joins the workers, waiting only for items already being
// built. `build` must be thread-safe when workers > 0. Not movable (the threads hold `this`).
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace kiln::data {

// The default read-ahead of the loaders (DataLoader, ImageLoader) when prefetch is 0: 2 batches
// per worker, at most this many (so --workers 1000 does not buffer 2000 batches).
inline constexpr int64_t kMaxDefaultPrefetch = 64;

template <typename T>
class OrderedPrefetch {
 public:
  OrderedPrefetch(int64_t n, int workers, int64_t capacity, std::function<T(int64_t)> build)
      : n_(n), capacity_(std::max<int64_t>(1, capacity)), build_(std::move(build)) {
    slots_.resize(size_t(capacity_));
    for (int i = 0; i < workers && i < n_; ++i) threads_.emplace_back([this] { work(); });
  }
  ~OrderedPrefetch() { stop(); }
  OrderedPrefetch(const OrderedPrefetch&) = delete;
  OrderedPrefetch& operator=(const OrderedPrefetch&) = delete;

  int64_t size() const { return n_; }

  std::optional<T> next() {
    if (finished_ || next_consume_ >= n_) {
      finished_ = true;
      return std::nullopt;
    }
    const int64_t k = next_consume_;
    if (threads_.empty()) {
      ++next_consume_;
      try {
        return build_(k);
      } catch (...) {
        finished_ = true;
        throw;
      }
    }
    std::unique_lock lk(mu_);
    auto& slot = slots_[size_t(k % capacity_)];
    // Items below error_item_ were all claimed before the failure and will still arrive.
    ready_cv_.wait(lk, [&] { return slot.has_value() || error_item_ <= k; });
    if (!slot) {
      finished_ = true;
      std::exception_ptr e = error_;
      lk.unlock();
      stop();
      std::rethrow_exception(e);
    }
    T item = std::move(*slot);
    slot.reset();
    ++next_consume_;
    lk.unlock();
    space_cv_.notify_all();
    return item;
  }

 private:
  void work() {
    while (true) {
      int64_t k;
      {
        std::unique_lock lk(mu_);
        space_cv_.wait(lk, [&] {
          return stop_ || error_ || next_claim_ >= n_ || next_claim_ < next_consume_ + capacity_;
        });
        if (stop_ || error_ || next_claim_ >= n_) return;
        k = next_claim_++;
      }
      try {
        T item = build_(k);
        std::lock_guard lk(mu_);
        slots_[size_t(k % capacity_)] = std::move(item);
      } catch (...) {
        std::lock_guard lk(mu_);
        if (k < error_item_) {
          error_item_ = k;
          error_ = std::current_exception();
        }
      }
      ready_cv_.notify_all();
      space_cv_.notify_all();
    }
  }

  void stop() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    space_cv_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

  const int64_t n_;
  const int64_t capacity_;
  std::function<T(int64_t)> build_;
  std::mutex mu_;
  std::condition_variable space_cv_, ready_cv_;
  std::vector<std::optional<T>> slots_;  // item k in slot k % capacity_
  int64_t next_claim_ = 0;               // guarded by mu_
  int64_t next_consume_ = 0;             // written by the consumer under mu_ (threaded mode)
  bool stop_ = false;
  std::exception_ptr error_;
  int64_t error_item_ = INT64_MAX;
  bool finished_ = false;  // consumer-only
  std::vector<std::thread> threads_;
};

}  // namespace kiln::data
