#include "tools/train/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "core/error.h"
#include "tools/cli/cli.h"

namespace kiln {

// Every message is {magic, op, length} + payload; the op catches ranks that disagree on which
// collective comes next.
enum class Rendezvous::Op : uint32_t { Hello = 1, Welcome, Broadcast, Gather, GatherResult };

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x6b6c6e31;  // "kln1"
constexpr uint64_t kMaxBlob = uint64_t(64) << 20;

struct Header {
  uint32_t magic;
  uint32_t op;
  uint64_t len;
};

const char* op_name(uint32_t op) {
  switch (op) {
    case 1:
      return "join";
    case 2:
      return "join";
    case 3:
      return "broadcast";
    case 4:
    case 5:
      return "all_gather";
    default:
      return "an unknown operation";
  }
}

double seconds(std::chrono::milliseconds d) { return double(d.count()) / 1000.0; }

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : int(std::min<int64_t>(left.count(), 1 << 30));
}

// Waits for `events` on fd until the deadline; false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, remaining_ms(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    KILN_CHECK(errno == EINTR, "rendezvous: poll failed: ", std::strerror(errno));
  }
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  KILN_CHECK(flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0,
             "rendezvous: fcntl failed: ", std::strerror(errno));
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // latency only; may fail
}

// Writes exactly n bytes before the deadline; `who` names the peer for errors.
void send_all(int fd, const void* data, size_t n, Clock::time_point deadline,
              const std::string& who) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= size_t(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    KILN_CHECK(w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), "rendezvous: sending to ", who,
               " failed: ", std::strerror(errno), " (did it exit?)");
    KILN_CHECK(wait_fd(fd, POLLOUT, deadline), "rendezvous: timed out sending to ", who);
  }
}

// Reads exactly n bytes before the deadline; false on timeout; throws on a closed connection.
bool recv_all(int fd, void* data, size_t n, Clock::time_point deadline, const std::string& who) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= size_t(r);
      continue;
    }
    KILN_CHECK(r != 0, "rendezvous: ", who,
               " closed the connection (it exited or failed; see its error)");
    if (errno == EINTR) continue;
    KILN_CHECK(errno == EAGAIN || errno == EWOULDBLOCK, "rendezvous: receiving from ", who,
               " failed: ", std::strerror(errno));
    if (!wait_fd(fd, POLLIN, deadline)) return false;
  }
  return true;
}

std::string rank_name(int r) { return "rank " + std::to_string(r); }

// The addresses of addr:port; addr "" with passive: the wildcard addresses (every interface).
// Null when addr does not resolve, with the reason in *error.
addrinfo* resolve(const std::string& addr, int port, bool passive, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(addr.empty() ? nullptr : addr.c_str(),
                               std::to_string(port).c_str(), &hints, &res);
  if (rc == 0 && res) return res;
  *error = ::gai_strerror(rc);
  return nullptr;
}

}  // namespace

Rendezvous::Rendezvous(const std::string& master_addr, int master_port, int rank, int world_size,
                       RendezvousOptions opts)
    : addr_(master_addr), port_(master_port), rank_(rank), world_size_(world_size), opts_(opts) {
  KILN_CHECK(world_size >= 1, "rendezvous: world_size must be >= 1, got ", world_size);
  KILN_CHECK(rank >= 0 && rank < world_size, "rendezvous: rank ", rank,
             " is out of range for world_size ", world_size);
  KILN_CHECK(master_port >= 1 && master_port <= 65535, "rendezvous: port ", master_port,
             " is out of range [1, 65535]");
  KILN_CHECK(opts.timeout.count() > 0, "rendezvous: timeout must be positive");
  addr_ = bare_host(addr_);
  where_ = host_port(addr_, port_);
  peers_.assign(size_t(rank == 0 ? world_size : 1), -1);
  if (world_size == 1) return;
  try {
    if (rank == 0)
      join_as_root();
    else
      join_as_peer();
  } catch (...) {
    close_all();  // the destructor does not run for a throwing constructor
    throw;
  }
}

Rendezvous::~Rendezvous() { close_all(); }

void Rendezvous::close_all() {
  for (int& fd : peers_)
    if (fd >= 0) ::close(std::exchange(fd, -1));
  if (listen_fd_ >= 0) ::close(std::exchange(listen_fd_, -1));
}

Clock::time_point Rendezvous::deadline() const { return Clock::now() + opts_.timeout; }

namespace {

// "localhost", "127.x.y.z", "::1" (in any spelling): the job stays on this host.
bool names_loopback(const std::string& addr) {
  in6_addr v6{};
  if (::inet_pton(AF_INET6, addr.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return addr == "localhost" || addr.rfind("127.", 0) == 0;
}

}  // namespace

void Rendezvous::join_as_root() {
  // Rank 0 listens on every interface unless MASTER_ADDR names the loopback: the others reach it
  // by MASTER_ADDR as they resolve it, which can differ from what this host resolves (a host
  // name that /etc/hosts maps to 127.0.1.1 here and DNS to the real address elsewhere).
  const bool loopback = names_loopback(addr_);
  std::string last_error = "no address";
  addrinfo* res = resolve(loopback ? addr_ : "", port_, true, &last_error);
  if (!res)
    cli::usage_error("rendezvous: rank 0 cannot resolve MASTER_ADDR '", addr_, "': ", last_error);
  // Of the wildcard addresses, IPv6's "::" first, made dual-stack: it takes IPv4 peers too, where
  // "0.0.0.0" would leave out the peers that reach rank 0 by an IPv6 address.
  std::vector<addrinfo*> order;
  for (addrinfo* a = res; a; a = a->ai_next)
    if (loopback || a->ai_family == AF_INET6) order.push_back(a);
  for (addrinfo* a = res; a; a = a->ai_next)
    if (!loopback && a->ai_family != AF_INET6) order.push_back(a);
  int last_error_code = 0;
  for (addrinfo* a : order) {
    if (listen_fd_ >= 0) break;
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1, zero = 0;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (!loopback && a->ai_family == AF_INET6)
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, world_size_) == 0) {
      listen_fd_ = fd;
    } else {
      last_error_code = errno;
      last_error = std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  const char* hint = last_error_code == EADDRINUSE
                         ? " (the port is taken: another job, or a launcher's own store; set "
                           "KILN_RDZV_PORT to a free port for every rank)"
                     : last_error_code == EADDRNOTAVAIL
                         ? " (MASTER_ADDR is not an address of this host: rank 0 must run there)"
                         : "";
  if (listen_fd_ < 0)
    cli::usage_error("rendezvous: rank 0 cannot listen on ", where_, ": ", last_error, hint);
  set_nonblocking(listen_fd_);

  const Clock::time_point until = deadline();
  int arrived = 1;
  while (arrived < world_size_) {
    if (!wait_fd(listen_fd_, POLLIN, until)) {
      std::string missing, present = "0";
      for (int r = 1; r < world_size_; ++r) {
        std::string& list = peers_[size_t(r)] < 0 ? missing : present;
        list += (list.empty() ? "" : ", ") + std::to_string(r);
      }
      KILN_FAIL("rendezvous: rank 0 timed out after ", seconds(opts_.timeout), " s on ", where_,
                " waiting for rank(s) ", missing, " of world size ", world_size_,
                " (arrived: ", present, ")");
    }
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;  // EAGAIN / aborted connection: keep waiting
    set_nodelay(fd);
    // A connection that is not a kiln rank (or dies before saying hello) is dropped.
    Header h{};
    uint32_t who[2] = {0, 0};  // rank, world_size
    bool ok = false;
    try {
      ok = recv_all(fd, &h, sizeof(h), until, "a connecting process") && h.magic == kMagic &&
           h.op == uint32_t(Op::Hello) && h.len == sizeof(who) &&
           recv_all(fd, who, sizeof(who), until, "a connecting process");
    } catch (const Error&) {
      ok = false;
    }
    if (!ok) {
      ::close(fd);
      continue;
    }
    const int r = int(who[0]);
    if (int(who[1]) != world_size_ || r < 1 || r >= world_size_ || peers_[size_t(r)] >= 0) {
      ::close(fd);
      // Processes given different world sizes, or the same rank: the launcher's variables.
      cli::usage_error(
          "rendezvous: rank 0 (world size ", world_size_, ") got a join from rank ", who[0],
          " with world size ", who[1],
          (r >= 1 && r < world_size_ && peers_[size_t(r)] >= 0) ? " (rank already joined)" : "",
          "; every process needs the same world size and a rank of its own");
    }
    peers_[size_t(r)] = fd;
    ++arrived;
  }
  op_deadline_ = deadline();
  for (int r = 1; r < world_size_; ++r) send_msg(peers_[size_t(r)], Op::Welcome, {}, r);
}

void Rendezvous::join_as_peer() {
  const Clock::time_point until = deadline();
  std::string last_error;
  int fd = -1;
  while (fd < 0) {
    std::string why;
    addrinfo* res = resolve(addr_, port_, false, &why);
    if (!res)
      cli::usage_error("rendezvous: rank ", rank_, " cannot resolve MASTER_ADDR '", addr_,
                       "': ", why);
    for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
      const int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (s < 0) continue;
      set_nonblocking(s);
      int rc = ::connect(s, a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        if (wait_fd(s, POLLOUT, std::min(until, Clock::now() + std::chrono::seconds(1)))) {
          int err = 0;
          socklen_t len = sizeof(err);
          ::getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len);
          rc = err == 0 ? 0 : -1;
          errno = err;
        } else {
          errno = ETIMEDOUT;
        }
      }
      if (rc == 0) {
        fd = s;
      } else {
        last_error = std::strerror(errno);
        ::close(s);
      }
    }
    ::freeaddrinfo(res);
    if (fd >= 0) break;
    if (Clock::now() >= until)
      cli::usage_error("rendezvous: rank ", rank_, " could not reach rank 0 at ", where_,
                       " within ", seconds(opts_.timeout), " s (last error: ", last_error,
                       "); is rank 0 running, and are MASTER_ADDR/MASTER_PORT (KILN_RDZV_PORT) "
                       "right?");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  set_nodelay(fd);
  peers_[0] = fd;
  // Rank 0 was listening when we connected, so its own deadline ends before ours; the slack
  // lets its verdict (the welcome, or a closed socket after naming the missing ranks) arrive.
  op_deadline_ = deadline() + std::min<Clock::duration>(opts_.timeout, std::chrono::seconds(5));
  const uint32_t who[2] = {uint32_t(rank_), uint32_t(world_size_)};
  Blob hello(sizeof(who));
  std::memcpy(hello.data(), who, sizeof(who));
  send_msg(fd, Op::Hello, hello, 0);
  recv_msg(fd, Op::Welcome, 0);
}

void Rendezvous::send_msg(int fd, Op op, const Blob& blob, int peer) {
  const Header h{kMagic, uint32_t(op), uint64_t(blob.size())};
  send_all(fd, &h, sizeof(h), op_deadline_, rank_name(peer));
  if (!blob.empty()) send_all(fd, blob.data(), blob.size(), op_deadline_, rank_name(peer));
}

Rendezvous::Blob Rendezvous::recv_msg(int fd, Op op, int peer) {
  const std::string who = rank_name(peer);
  Header h{};
  KILN_CHECK(recv_all(fd, &h, sizeof(h), op_deadline_, who), "rendezvous: rank ", rank_,
             " timed out after ", seconds(opts_.timeout), " s in ", op_name(uint32_t(op)),
             " waiting for ", who);
  KILN_CHECK(h.magic == kMagic, "rendezvous: rank ", rank_, " got a corrupt message from ", who);
  KILN_CHECK(h.op == uint32_t(op), "rendezvous: ranks disagree on the collective: rank ", rank_,
             " is in ", op_name(uint32_t(op)), " but ", who, " is in ", op_name(h.op));
  KILN_CHECK(h.len <= kMaxBlob, "rendezvous: ", who, " sent ", h.len, " bytes (limit ", kMaxBlob,
             ")");
  Blob blob(size_t(h.len));
  KILN_CHECK(blob.empty() || recv_all(fd, blob.data(), blob.size(), op_deadline_, who),
             "rendezvous: rank ", rank_, " timed out in ", op_name(uint32_t(op)),
             " receiving from ", who);
  return blob;
}

Rendezvous::Blob Rendezvous::broadcast(const Blob& blob) {
  KILN_CHECK(blob.size() <= kMaxBlob || rank_ != 0, "rendezvous: broadcast blob of ", blob.size(),
             " bytes exceeds the limit of ", kMaxBlob);
  if (world_size_ == 1) return blob;
  op_deadline_ = deadline();
  if (rank_ != 0) return recv_msg(peers_[0], Op::Broadcast, 0);
  for (int r = 1; r < world_size_; ++r) send_msg(peers_[size_t(r)], Op::Broadcast, blob, r);
  return blob;
}

std::vector<Rendezvous::Blob> Rendezvous::all_gather(const Blob& blob) {
  KILN_CHECK(blob.size() <= kMaxBlob, "rendezvous: all_gather blob of ", blob.size(),
             " bytes exceeds the limit of ", kMaxBlob);
  if (world_size_ == 1) return {blob};
  op_deadline_ = deadline();
  std::vector<Blob> all(static_cast<size_t>(world_size_));
  if (rank_ != 0) {
    send_msg(peers_[0], Op::Gather, blob, 0);
    // Rank 0 answers with every blob as {u64 length, bytes} in rank order.
    const Blob packed = recv_msg(peers_[0], Op::GatherResult, 0);
    size_t pos = 0;
    for (Blob& b : all) {
      uint64_t n = 0;
      KILN_CHECK(pos + sizeof(n) <= packed.size(), "rendezvous: malformed all_gather result");
      std::memcpy(&n, packed.data() + pos, sizeof(n));
      pos += sizeof(n);
      KILN_CHECK(n <= packed.size() - pos, "rendezvous: malformed all_gather result");
      b.assign(packed.begin() + ptrdiff_t(pos), packed.begin() + ptrdiff_t(pos + n));
      pos += n;
    }
    return all;
  }
  all[0] = blob;
  for (int r = 1; r < world_size_; ++r) all[size_t(r)] = recv_msg(peers_[size_t(r)], Op::Gather, r);
  Blob packed;
  for (const Blob& b : all) {
    const uint64_t n = b.size();
    const auto* p = reinterpret_cast<const uint8_t*>(&n);
    packed.insert(packed.end(), p, p + sizeof(n));
    packed.insert(packed.end(), b.begin(), b.end());
  }
  KILN_CHECK(packed.size() <= kMaxBlob, "rendezvous: all_gather result of ", packed.size(),
             " bytes exceeds the limit of ", kMaxBlob);
  for (int r = 1; r < world_size_; ++r) send_msg(peers_[size_t(r)], Op::GatherResult, packed, r);
  return all;
}

void Rendezvous::barrier() { all_gather({}); }

}  // namespace kiln
