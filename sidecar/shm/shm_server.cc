// The shm server's loop: one thread that polls every attached engine's
// ring, sleeps in epoll when all are idle, accepts connections to the attach
// socket and times out those that never attach. The attach handshake is in
// internal/shm_attach.cc, one engine's frames in internal/shm_session.cc.
#include "sidecar/shm/shm_server.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/ids.h"
#include "common/shm_format.h"
#include "common/thread.h"
#include "sidecar/shm/internal/shm_attach.h"
#include "sidecar/shm/internal/shm_session.h"

namespace leap::sidecar {

using shm_internal::AttachContext;
using shm_internal::AttachEngine;
using shm_internal::MarkServerThread;
using shm_internal::Refuse;
using shm_internal::SessionScratch;
using shm_internal::ShmSession;
using shm_internal::Waker;

absl::Status ShmServerOptions::Validate() const {
  if (path.empty()) return absl::InvalidArgumentError("shm: path is required");
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm: path '", path, "' is longer than ",
                     sizeof(sockaddr_un::sun_path) - 1, " bytes"));
  }
  if (spin < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("shm: spin must be >= 0");
  }
  if (max_slots < 1 || max_slots > shm::kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm: max_slots must be in [1, ", shm::kMaxSlots, "]"));
  }
  if (max_ring_bytes < shm::kMinRingBytes ||
      max_ring_bytes > shm::kMaxRingBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm: max_ring_bytes must be in [", shm::kMinRingBytes,
                     ", ", shm::kMaxRingBytes, "]"));
  }
  if (max_engines < 1)
    return absl::InvalidArgumentError("shm: max_engines >= 1");
  return absl::OkStatus();
}

namespace {

// A connection that has not attached within this long is closed.
constexpr int64_t kAttachTimeoutNs = int64_t{5} * 1'000'000'000;

uint64_t Tag(uint64_t key, uint64_t kind) { return key << 2 | kind; }

}  // namespace

// The server's state. `stop` and `waker` are shared with Stop (any
// thread); everything else belongs to the server thread while it runs, and
// to Start before it and Stop after it is joined.
struct ShmServer::Impl {
  Core* core;
  std::string sidecar_id;
  ShmServerOptions options;
  int listen_fd = -1;
  bool bound = false;
  int epfd = -1;
  std::shared_ptr<Waker> waker = std::make_shared<Waker>();
  std::atomic<bool> stop{false};
  std::thread thread;
  absl::flat_hash_map<uint64_t, std::shared_ptr<ShmSession>> attachments;
  uint64_t next_key = 1;  // epoll tags: key << 2 | kind
  std::mt19937_64 rng{std::random_device{}()};
  SessionScratch scratch;
  std::atomic<uint64_t>* next_session;

  static constexpr uint64_t kListenTag = 0;
  static constexpr uint64_t kWakerTag = 1;

  void Loop();
  void Accept();
  void OnSocket(const std::shared_ptr<ShmSession>& a);
  void HandleAttach(const std::shared_ptr<ShmSession>& a);
};

ShmServer::ShmServer(Core* core, std::string sidecar_id,
                     ShmServerOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  impl_->core = core;
  impl_->sidecar_id = std::move(sidecar_id);
  impl_->options = options_;
}

absl::StatusOr<std::unique_ptr<ShmServer>> ShmServer::Start(
    Core* core, std::string sidecar_id, ShmServerOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<ShmServer> server(
      new ShmServer(core, std::move(sidecar_id), std::move(options)));
  Impl& im = *server->impl_;
  if (absl::Status s = shm_internal::BindAttachSocket(server->options_,
                                                      &im.listen_fd, &im.bound);
      !s.ok()) {
    return s;
  }
  im.epfd = epoll_create1(EPOLL_CLOEXEC);
  im.waker->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (im.epfd < 0 || im.waker->efd < 0) {
    return absl::InternalError(
        absl::StrCat("shm: epoll/eventfd: ", std::strerror(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = Impl::kListenTag;
  epoll_ctl(im.epfd, EPOLL_CTL_ADD, im.listen_fd, &ev);
  ev.data.u64 = Impl::kWakerTag;
  epoll_ctl(im.epfd, EPOLL_CTL_ADD, im.waker->efd, &ev);
  static std::atomic<uint64_t> sessions{uint64_t{1} << 40};
  im.next_session = &sessions;
  im.thread = std::thread([&im] { im.Loop(); });
  NameThread(im.thread, "leap-shm");
  return server;
}

ShmServer::~ShmServer() { Stop(); }

void ShmServer::Stop() {
  Impl& im = *impl_;
  if (im.stop.exchange(true)) return;
  im.waker->Notify();
  {
    const uint64_t one = 1;
    (void)!write(im.waker->efd, &one, sizeof(one));
  }
  if (im.thread.joinable()) im.thread.join();
  // The thread is gone: detach every engine from here (its requests are
  // cancelled, it sees leapd leave, its segment is removed).
  for (auto& [key, a] : im.attachments) {
    if (a->attached && !a->dead)
      a->Detach("leapd is stopping", false, "stopping");
  }
  im.attachments.clear();
  if (im.listen_fd >= 0) close(im.listen_fd);
  if (im.bound) unlink(options_.path.c_str());
  if (im.epfd >= 0) close(im.epfd);
}

// ------------------------------------------------------------- the loop

void ShmServer::Impl::Loop() {
  MarkServerThread();
  const int64_t spin_ns = absl::ToInt64Nanoseconds(options.spin);
  int64_t last_busy = NowNs();
  uint32_t iterations = 0;
  epoll_event evs[64];
  while (!stop.load(std::memory_order_relaxed)) {
    bool busy = false;
    // A full barrier before the flags Service reads (has_publish, the
    // release bitmap): a Notify after this point is never lost.
    waker->pending.exchange(false, std::memory_order_seq_cst);
    for (auto& [key, a] : attachments) {
      if (a->attached && !a->dead) busy |= a->Service();
    }
    const int64_t now = (++iterations & 63) == 0 || !busy ? NowNs() : last_busy;
    if (busy) last_busy = now;
    int timeout = 0;
    if (!busy && now - last_busy >= spin_ns) {
      // Sleep: announce it on every ring, then re-check (Dekker with the
      // producers' publish-then-check).
      waker->sleeping.store(true);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      bool ready = waker->pending.load();
      for (auto& [key, a] : attachments) {
        if (!a->attached || a->dead) continue;
        if (!a->pending.empty()) {
          // Input waits for room in the engine's ring: sleep until the
          // engine frees some (it wakes us), not until more input comes.
          a->waiting_space = true;
          if (!a->out.PrepareWaitForSpace(a->pending.front().second.size())) {
            ready = true;
          }
        } else if (!a->in.PrepareSleep()) {
          ready = true;
        }
      }
      bool unattached = false;
      for (const auto& [key, a] : attachments)
        unattached |= !a->attached && !a->dead;
      // With connections still to attach, wake up to time them out.
      timeout = ready ? 0 : (unattached ? 1000 : -1);
    } else if ((iterations & 63) != 0) {
      continue;  // busy or spinning: look at the sockets every 64 rounds
    }
    const int n = epoll_wait(epfd, evs, 64, timeout);
    waker->sleeping.store(false);
    for (auto& [key, a] : attachments) {
      if (a->attached && !a->dead) {
        a->in.CancelSleep();
        if (a->waiting_space) {  // only where set: the engine shares the line
          a->out.control()->space_wanted.store(0, std::memory_order_relaxed);
          a->waiting_space = false;
        }
      }
    }
    if (timeout != 0) last_busy = NowNs();
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = evs[i].data.u64;
      if (tag == kListenTag) {
        Accept();
      } else if (tag == kWakerTag) {
        uint64_t v;
        (void)!read(waker->efd, &v, sizeof(v));
      } else {
        auto it = attachments.find(tag >> 2);
        if (it == attachments.end()) continue;
        if ((tag & 3) == 2) {
          OnSocket(it->second);
        } else {
          uint64_t v;
          (void)!read(it->second->efd, &v, sizeof(v));
        }
      }
    }
    const int64_t now_ns = NowNs();
    for (auto it = attachments.begin(); it != attachments.end();) {
      auto cur = it++;
      ShmSession& a = *cur->second;
      if (!a.attached && !a.dead && now_ns - a.accepted_ns > kAttachTimeoutNs) {
        a.dead = true;  // connected but never said hello
        core->metrics().shm_refused().Increment();
      }
      if (a.dead) attachments.erase(cur);
    }
  }
}

void ShmServer::Impl::Accept() {
  for (;;) {
    const int fd =
        accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    int waiting = 0;
    for (const auto& [k, other] : attachments) {
      waiting += !other->attached && !other->dead;
    }
    if (waiting >= options.max_engines) {
      close(fd);  // too many connections that have not attached: refuse
      core->metrics().shm_refused().Increment();
      continue;
    }
    auto a = std::make_shared<ShmSession>();
    a->core = core;
    a->epfd = epfd;
    a->scratch = &scratch;
    a->waker = waker;
    a->accepted_ns = NowNs();
    a->sock = fd;
    const uint64_t key = next_key++;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = Tag(key, 2);
    epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
    attachments[key] = a;
  }
}

void ShmServer::Impl::OnSocket(const std::shared_ptr<ShmSession>& a) {
  if (a->dead) return;
  if (!a->attached) {
    HandleAttach(a);
    return;
  }
  // An attached engine only ever hangs up.
  char buf[256];
  const ssize_t n = recv(a->sock, buf, sizeof(buf), MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
    a->Detach("engine hung up", false, "hangup");
  }
}

void ShmServer::Impl::HandleAttach(const std::shared_ptr<ShmSession>& a) {
  std::string packet;
  std::vector<int> fds;
  absl::Status s =
      shm::ReceivePacket(a->sock, &packet, &fds, shm::kMaxAttachPacket);
  for (int fd : fds) close(fd);             // an engine never sends fds
  if (absl::IsDeadlineExceeded(s)) return;  // nothing to read yet
  if (absl::IsInvalidArgument(s)) {
    // Larger than any valid attach request (its hello's ids are bounded):
    // refused in words, not by hanging up.
    Refuse(*core, a.get(),
           absl::InvalidArgumentError(absl::StrCat(
               "shm attach request larger than ", shm::kMaxAttachPacket,
               " bytes (a hello's engine_id and model_id hold at most ",
               kMaxIdBytes, " bytes each, its instance_id 128)")));
    return;
  }
  if (absl::IsFailedPrecondition(s)) {  // more fds than a packet may carry
    Refuse(*core, a.get(), absl::InvalidArgumentError(s.message()));
    return;
  }
  if (!s.ok()) {
    a->dead = true;  // hung up (or failed) before attaching
    return;
  }
  AttachContext ctx;
  ctx.core = core;
  ctx.options = &options;
  ctx.sidecar_id = &sidecar_id;
  for (auto& [k, other] : attachments) {
    ctx.attached_now += other->attached && !other->dead;
  }
  ctx.rng = &rng;
  ctx.next_session = next_session;
  s = AttachEngine(ctx, packet, a.get());
  if (!s.ok()) {
    Refuse(*core, a.get(), s);
    return;
  }
  if (a->dead) return;  // hung up before the grant reached it
  uint64_t key = 0;
  for (auto& [k, v] : attachments) {
    if (v == a) key = k;
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = Tag(key, 3);
  epoll_ctl(epfd, EPOLL_CTL_ADD, a->efd, &ev);
  a->attached = true;
  core->hub().Subscribe(attachments[key]);
  core->metrics().connected_engines().Increment();
  std::printf(
      "shm: engine '%s' attached: %lld slots, dim %lld %s, segment %s\n",
      a->hello.engine_id().c_str(),
      static_cast<long long>(a->layout.slot_count),
      static_cast<long long>(a->layout.dim),
      std::string(readout::DTypeName(a->dtype)).c_str(), a->seg_path.c_str());
  std::fflush(stdout);
}

}  // namespace leap::sidecar
