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
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "core/error.h"

namespace kiln::data {

// The default read-ahead of the loaders (DataLoader, ImageLoader) when prefetch is 0: 2 batches
// per worker, at most this many (so --workers 1000 does not buffer 2000 batches).
inline constexpr int64_t kMaxDefaultPrefetch = 64;

// PartedPrefetch<T>: like OrderedPrefetch, but each item is built in `parts` pieces that
// different workers fill in parallel, so one item's latency is (its work) / workers rather than
// its whole work on one thread, and every worker stays busy up to the end of the sequence.
// Workers claim (item, part) pairs in order; `make(k)` creates item k (called once, under the
// queue's lock, by the worker that claims its part 0: keep it cheap, e.g. a pooled buffer);
// `fill(item, k, part)` writes part `part` of it, concurrently with other parts of the same item
// (so it must only read `item` and write memory no other part writes). At most `capacity` items
// are made and not yet consumed. parts(k) >= 1. Errors and shutdown as OrderedPrefetch: a throw
// from make or fill for item k reaches the consumer after items 0..k-1.
template <typename T>
class PartedPrefetch {
 public:
  PartedPrefetch(int64_t n, int workers, int64_t capacity, std::function<int64_t(int64_t)> parts,
                 std::function<T(int64_t)> make,
                 std::function<void(T&, int64_t, int64_t)> fill)
      : n_(n),
        capacity_(std::max<int64_t>(1, capacity)),
        parts_(std::move(parts)),
        make_(std::move(make)),
        fill_(std::move(fill)) {
    slots_.resize(size_t(capacity_));
    try {
      for (int i = 0; i < workers && n_ > 0; ++i) threads_.emplace_back([this] { work(); });
    } catch (const std::system_error& e) {
      // Out of threads (ulimit -u, memory for stacks): the ones started are stopped and joined,
      // and the error says how many could start.
      const size_t started = threads_.size();
      stop();
      throw Error("cannot start " + std::to_string(workers) + " data-loading threads (" +
                  std::to_string(started) + " started, then: " + e.what() +
                  "); use fewer workers");
    }
  }
  ~PartedPrefetch() { stop(); }
  PartedPrefetch(const PartedPrefetch&) = delete;
  PartedPrefetch& operator=(const PartedPrefetch&) = delete;

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
        T item = make_(k);
        for (int64_t p = 0, np = parts_(k); p < np; ++p) fill_(item, k, p);
        return item;
      } catch (...) {
        finished_ = true;
        throw;
      }
    }
    std::unique_lock lk(mu_);
    Slot& slot = slots_[size_t(k % capacity_)];
    ready_cv_.wait(lk, [&] { return (slot.item && slot.remaining == 0) || error_item_ <= k; });
    if (error_item_ <= k) {
      finished_ = true;
      std::exception_ptr e = error_;
      lk.unlock();
      stop();
      std::rethrow_exception(e);
    }
    T item = std::move(*slot.item);
    slot.item.reset();
    ++next_consume_;
    lk.unlock();
    space_cv_.notify_all();
    return item;
  }

 private:
  struct Slot {
    std::optional<T> item;
    int64_t remaining = 0;  // parts not yet filled
  };

  void work() {
    while (true) {
      int64_t k, part;
      Slot* slot;
      {
        std::unique_lock lk(mu_);
        space_cv_.wait(lk, [&] {
          return stop_ || error_ || claim_item_ >= n_ || claim_part_ > 0 ||
                 claim_item_ < next_consume_ + capacity_;
        });
        if (stop_ || error_ || claim_item_ >= n_) return;
        k = claim_item_;
        part = claim_part_;
        slot = &slots_[size_t(k % capacity_)];
        if (part == 0) {
          try {
            slot->item = make_(k);
            slot->remaining = claim_parts_ = parts_(k);
          } catch (...) {
            fail(k);
            ready_cv_.notify_all();
            return;
          }
        }
        if (++claim_part_ == claim_parts_) {
          ++claim_item_;
          claim_part_ = 0;
        }
      }
      bool ok = true;
      try {
        fill_(*slot->item, k, part);
      } catch (...) {
        std::lock_guard lk(mu_);
        fail(k);
        ok = false;
      }
      bool done = false;
      if (ok) {
        std::lock_guard lk(mu_);
        done = --slot->remaining == 0;
      }
      if (done || !ok) ready_cv_.notify_all();
      if (!ok) space_cv_.notify_all();
    }
  }

  void fail(int64_t k) {  // under mu_
    if (k < error_item_) {
      error_item_ = k;
      error_ = std::current_exception();
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
  std::function<int64_t(int64_t)> parts_;
  std::function<T(int64_t)> make_;
  std::function<void(T&, int64_t, int64_t)> fill_;
  std::mutex mu_;
  std::condition_variable space_cv_, ready_cv_;
  std::vector<Slot> slots_;  // item k in slot k % capacity_
  int64_t claim_item_ = 0, claim_part_ = 0, claim_parts_ = 0;  // guarded by mu_
  int64_t next_consume_ = 0;  // written by the consumer under mu_ (threaded mode)
  bool stop_ = false;
  std::exception_ptr error_;
  int64_t error_item_ = INT64_MAX;
  bool finished_ = false;  // consumer-only
  std::vector<std::thread> threads_;
};

// OrderedPrefetch<T>: PartedPrefetch with one part per item, built whole by the worker that
// claims it (outside the queue's lock).
template <typename T>
class OrderedPrefetch {
 public:
  OrderedPrefetch(int64_t n, int workers, int64_t capacity, std::function<T(int64_t)> build)
      : q_(
            n, workers, capacity, [](int64_t) { return int64_t(1); },
            [](int64_t) { return std::optional<T>(); },
            [b = std::move(build)](std::optional<T>& item, int64_t k, int64_t) { item = b(k); }) {}

  int64_t size() const { return q_.size(); }

  std::optional<T> next() {
    std::optional<std::optional<T>> item = q_.next();
    if (!item) return std::nullopt;
    return std::move(*item);
  }

 private:
  PartedPrefetch<std::optional<T>> q_;
};

}  // namespace kiln::data
