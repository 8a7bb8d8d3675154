#pragma once
// A small TCP rendezvous among the processes of a data-parallel job (no NCCL needed): rank 0
// listens on a port (DistEnv::rdzv_port: MASTER_PORT, or the next port under torchrun, whose
// agent holds MASTER_PORT; see tools/train/dist_env.h) of every interface, IPv4 and IPv6 — only
// the loopback when MASTER_ADDR is localhost, 127.x.y.z or ::1 — and every other rank connects to
// MASTER_ADDR:port, and all later exchanges run over those connections (a star through rank 0).
// MASTER_ADDR may be an IPv6 literal, bare or in brackets ("::1", "[::1]"); messages show
// "[::1]:29500". It carries what must be agreed before NCCL exists — the ncclUniqueId bytes
// (broadcast) — and small host-side agreements (all_gather, barrier). It is not a data path:
// blobs are meant to be small (<= 64 MiB each).
//
//   Rendezvous rv(DistEnv::from_env(), {.timeout = std::chrono::seconds(60)});
//   Rendezvous::Blob id = rv.broadcast(rank == 0 ? make_id() : Rendezvous::Blob{});
//
// Construction returns once every rank has joined (it is a barrier). Bounded waits everywhere:
//  * rank 0 waits at most `timeout` for the others; on expiry it throws a kiln::Error naming the
//    ranks that did not arrive, and closes its socket (the ranks that did arrive then fail too);
//  * another rank retries connecting for at most `timeout`; on expiry it throws naming the
//    address it could not reach and the last socket error;
//  * each collective waits at most `timeout` for its peers and names the rank it waited for.
// What the launcher's variables got wrong is a cli::UsageError (tools/cli/cli.h: one line, no
// source location): MASTER_ADDR that does not resolve, a port rank 0 cannot listen on, rank 0
// unreachable, a join with another world size or a rank that already joined.
// Every rank must call the same collectives in the same order; a mismatch (rank 0 in
// broadcast, rank 2 in all_gather) is detected and reported. Not thread-safe: one thread per
// Rendezvous. A peer that exits mid-way is reported as a closed connection.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tools/train/dist_env.h"

namespace kiln {

struct RendezvousOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

class Rendezvous {
 public:
  using Blob = std::vector<uint8_t>;

  // Throws kiln::Error for rank outside [0, world_size), world_size < 1 or port outside
  // [1, 65535] (DistEnv has checked them), cli::UsageError for an address that does not resolve
  // or a port rank 0 cannot bind (in use).
  Rendezvous(const std::string& master_addr, int master_port, int rank, int world_size,
             RendezvousOptions opts = {});
  explicit Rendezvous(const DistEnv& env, RendezvousOptions opts = {})
      : Rendezvous(env.master_addr, env.rdzv_port, env.rank, env.world_size, opts) {}
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Returns rank 0's `blob` on every rank (the argument of other ranks is ignored).
  Blob broadcast(const Blob& blob);
  // Returns every rank's blob, indexed by rank, on every rank. Blobs may differ in size.
  std::vector<Blob> all_gather(const Blob& blob);
  // Returns once every rank has called barrier().
  void barrier();

 private:
  enum class Op : uint32_t;
  void close_all();
  void join_as_root();
  void join_as_peer();
  void send_msg(int fd, Op op, const Blob& blob, int peer);
  Blob recv_msg(int fd, Op op, int peer);
  std::chrono::steady_clock::time_point deadline() const;

  std::string addr_;
  int port_;
  int rank_;
  int world_size_;
  RendezvousOptions opts_;
  std::string where_;       // "127.0.0.1:29500", "[::1]:29500": for messages
  int listen_fd_ = -1;      // rank 0
  std::vector<int> peers_;  // rank 0: fd of rank r at [r] (-1 at [0]); others: [0] = rank 0
  std::chrono::steady_clock::time_point op_deadline_;
};

}  // namespace kiln
