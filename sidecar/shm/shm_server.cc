#include "sidecar/shm/shm_server.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <unordered_map>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/shm_format.h"
#include "common/status_macros.h"
#include "sidecar/core/engine_messages.h"

namespace leap::sidecar {

namespace pb = ::leap::v1;
using shm::FrameKind;

absl::Status ShmServerOptions::Validate() const {
  if (path.empty()) return absl::InvalidArgumentError("shm: path is required");
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: path '", path, "' is longer than ",
        sizeof(sockaddr_un::sun_path) - 1, " bytes"));
  }
  if (spin < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("shm: spin must be >= 0");
  }
  if (max_slots < 1 || max_slots > shm::kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: max_slots must be in [1, ", shm::kMaxSlots, "]"));
  }
  if (max_ring_bytes < shm::kMinRingBytes || max_ring_bytes > shm::kMaxRingBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: max_ring_bytes must be in [", shm::kMinRingBytes, ", ",
        shm::kMaxRingBytes, "]"));
  }
  if (max_engines < 1) return absl::InvalidArgumentError("shm: max_engines >= 1");
  return absl::OkStatus();
}

namespace {

// Answers buffered for an engine whose ring is full before it is detached.
constexpr size_t kMaxPendingBytes = size_t{64} << 20;
// A connection that has not attached within this long is closed.
constexpr int64_t kAttachTimeoutNs = int64_t{5} * 1'000'000'000;

// Trims per-request errors off an answer that would not fit one frame of
// the engine's ring, keeping every count and adding one summary error: the
// work done is still reported as done.
void FitAnswer(pb::SidecarMessage* m, size_t limit) {
  size_t total = m->ByteSizeLong();
  if (total <= limit) return;
  google::protobuf::RepeatedPtrField<pb::RequestError>* errors = nullptr;
  if (m->has_ack()) {
    errors = m->mutable_ack()->mutable_errors();
  } else if (m->has_predictions()) {
    errors = m->mutable_predictions()->mutable_errors();
  }
  if (errors == nullptr) return;
  int keep = errors->size();
  constexpr size_t kSummary = 256;  // the summary error, with room to spare
  while (keep > 0 && total + kSummary > limit) {
    --keep;
    total -= (*errors)[keep].ByteSizeLong() + 5;  // tag + length prefix
  }
  const int omitted = errors->size() - keep;
  if (omitted == 0) return;
  errors->DeleteSubrange(keep, omitted);
  pb::RequestError* e = errors->Add();
  e->set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
  e->set_message(absl::StrCat(omitted,
                              " more per-request errors omitted: they do not "
                              "fit one frame of this engine's ring"));
}

// Wakes the server thread from any thread (slot releases, publishes).
struct Waker {
  int efd = -1;
  std::atomic<bool> sleeping{false};
  std::atomic<bool> pending{false};
  ~Waker() {
    if (efd >= 0) close(efd);
  }
  void Notify() {
    // Release: the caller's earlier stores (a released slot, a publish) are
    // visible to whoever sees `pending`.
    pending.store(true, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (sleeping.load(std::memory_order_relaxed)) {
      const uint64_t one = 1;
      (void)!write(efd, &one, sizeof(one));
    }
  }
};

// True on the shm server thread (it flushes releases itself; other threads
// must wake it).
thread_local bool tls_shm_thread = false;

// An engine's mapped segment, and the slots its live requests no longer
// read: a bitmap any thread sets (a request destroyed on an RLS or gRPC
// thread) and the server thread drains into kRelease frames. Outlives its
// Attachment while any live request still reads a slot.
struct Mapping final : public ExternalFeatures {
  void* base = nullptr;
  size_t bytes = 0;
  std::shared_ptr<Waker> waker;
  std::unique_ptr<std::atomic<uint64_t>[]> released;
  size_t words = 0;
  std::atomic<bool> any_released{false};

  Mapping(size_t slots) : released(new std::atomic<uint64_t>[(slots + 63) / 64]),
                          words((slots + 63) / 64) {
    for (size_t i = 0; i < words; ++i) released[i].store(0);
  }
  ~Mapping() override {
    if (base != nullptr) munmap(base, bytes);
  }
  void Release(uint32_t slot) override {
    released[slot >> 6].fetch_or(uint64_t{1} << (slot & 63),
                                 std::memory_order_release);
    any_released.store(true, std::memory_order_release);
    if (!tls_shm_thread) waker->Notify();
  }
  // Appends the released slots to `out` and clears them.
  void Drain(std::vector<uint32_t>* out) {
    if (!any_released.exchange(false, std::memory_order_acquire)) return;
    for (size_t i = 0; i < words; ++i) {
      uint64_t w = released[i].exchange(0, std::memory_order_acquire);
      while (w != 0) {
        const int b = __builtin_ctzll(w);
        out->push_back(static_cast<uint32_t>(i * 64 + b));
        w &= w - 1;
      }
    }
  }
};

}  // namespace

// One attached engine. Everything but the publish queue is touched by the
// server thread only.
struct Attachment final : public PublishListener, public LiveTracker {
  uint64_t attach_id = 0;
  uint64_t session = 0;
  int64_t accepted_ns = 0;
  bool waiting_space = false;  // this round's sleep waits for ring room
  int sock = -1;
  int efd = -1;  // the engine writes it to wake the server
  bool attached = false;
  bool dead = false;
  std::string seg_path;
  std::shared_ptr<Mapping> mapping;
  shm::SegmentHeader* hdr = nullptr;
  shm::Layout layout;
  shm::Ring in, out;
  pb::Hello hello;
  readout::DType dtype = readout::DType::kFloat32;
  std::vector<uint8_t> held;
  // Frames waiting for room in the engine's ring (it reads too slowly).
  std::deque<std::pair<FrameKind, std::string>> pending;
  size_t pending_bytes = 0;
  bool out_dirty = false;
  // Live requests to rescore: by slot for slot-backed ones (an entry is
  // overwritten when its slot is reused), by id for features sent inline.
  std::vector<std::weak_ptr<LiveRequest>> by_slot;
  absl::flat_hash_map<std::string, std::weak_ptr<LiveRequest>> inline_live;
  size_t prune_at = 1024;
  std::shared_ptr<Waker> waker;

  absl::Mutex pub_mu;
  std::vector<std::pair<std::string, int64_t>> published ABSL_GUARDED_BY(pub_mu);
  std::unordered_map<std::string, std::shared_ptr<const PublishedVersion>>
      rescore ABSL_GUARDED_BY(pub_mu);
  std::atomic<bool> has_publish{false};

  ~Attachment() override {
    if (sock >= 0) close(sock);
    if (efd >= 0) close(efd);
  }

  void OnPublish(const std::string& readout,
                 const std::shared_ptr<const PublishedVersion>& v) override {
    {
      absl::MutexLock lock(&pub_mu);
      published.emplace_back(readout, v->version);
      auto& slot = rescore[readout];
      if (slot == nullptr || slot->version < v->version) slot = v;
    }
    has_publish.store(true);
    waker->Notify();
  }
  void Track(std::shared_ptr<LiveRequest> r) override {
    if (r->owner.get() == mapping.get() && r->slot < by_slot.size()) {
      by_slot[r->slot] = std::move(r);
      return;
    }
    inline_live[r->request_id] = r;
    if (inline_live.size() > prune_at) {
      for (auto it = inline_live.begin(); it != inline_live.end();) {
        auto cur = it++;
        auto p = cur->second.lock();
        if (p == nullptr || p->gone.load()) inline_live.erase(cur);
      }
      prune_at = std::max<size_t>(1024, 2 * inline_live.size());
    }
  }
  // Slot-backed requests need no untracking: a gone request is skipped, and
  // its entry is overwritten when the slot comes back.
  void Untrack(absl::string_view id) override { inline_live.erase(id); }
  // Every tracked request still live (for rescoring and reclaiming).
  std::vector<std::shared_ptr<LiveRequest>> Live() {
    std::vector<std::shared_ptr<LiveRequest>> out;
    for (auto& w : by_slot) {
      auto r = w.lock();
      if (r != nullptr && !r->gone.load()) out.push_back(std::move(r));
    }
    for (auto it = inline_live.begin(); it != inline_live.end();) {
      auto cur = it++;
      auto r = cur->second.lock();
      if (r == nullptr || r->gone.load()) {
        inline_live.erase(cur);
        continue;
      }
      out.push_back(std::move(r));
    }
    return out;
  }
  char* Slot(uint32_t i) const {
    return static_cast<char*>(mapping->base) + layout.slots_offset +
           uint64_t{layout.slot_bytes} * i;
  }
};

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
  absl::flat_hash_map<uint64_t, std::shared_ptr<Attachment>> attachments;
  uint64_t next_key = 1;  // epoll tags: key << 2 | kind
  std::mt19937_64 rng{std::random_device{}()};
  std::string scratch_p, scratch_e;
  // HandleFeatures' reusable buffers.
  std::vector<std::pair<shm::FeatureRecordView, int>> records_;
  std::vector<ScoreRequest> reqs_;
  std::vector<absl::StatusOr<ScoreResult>> results_;
  std::vector<std::shared_ptr<LiveRequest>> lives_;
  std::vector<absl::string_view> cancel_ids_;
  std::vector<uint32_t> released_;
  std::atomic<uint64_t>* next_session;

  static constexpr uint64_t kListenTag = 0;
  static constexpr uint64_t kWakerTag = 1;

  void Loop();
  void Accept();
  void OnSocket(const std::shared_ptr<Attachment>& a);
  void HandleAttach(const std::shared_ptr<Attachment>& a);
  absl::Status Attach(Attachment& a, const std::string& packet);
  void Refuse(Attachment& a, const absl::Status& s);
  bool Service(Attachment& a);
  void HandleFeatures(Attachment& a, const char* payload, size_t bytes);
  void HandleProto(Attachment& a, const char* payload, size_t bytes);
  void HandleCancels(Attachment& a, const char* payload, size_t bytes);
  void Emit(Attachment& a, FrameKind kind, const std::string& bytes);
  void EmitParts(Attachment& a, FrameKind kind,
                 std::initializer_list<absl::string_view> parts);
  void EmitProto(Attachment& a, const pb::SidecarMessage& m);
  bool FlushPending(Attachment& a);
  void FlushReleases(Attachment& a);
  void FlushPublishes(Attachment& a);
  // `label`: the leap_shm_detached_total reason.
  void Detach(Attachment& a, const std::string& why, bool corrupt,
              const char* label);
  void Publish(Attachment& a);
};

namespace {
uint64_t Tag(uint64_t key, uint64_t kind) { return key << 2 | kind; }
}  // namespace

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
  const std::string& path = server->options_.path;

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  // A socket file left by a dead leapd is replaced; a live one is not.
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shm: '", path, "' exists and is not a socket; refusing to replace it"));
    }
    int probe = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    const bool live = connect(probe, reinterpret_cast<sockaddr*>(&addr),
                              sizeof(addr)) == 0;
    close(probe);
    if (live) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shm: another leapd is serving '", path, "'"));
    }
    unlink(path.c_str());
  }
  // Segments of a dead leapd's engines.
  {
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
    const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    if (DIR* d = opendir(dir.c_str())) {
      while (dirent* e = readdir(d)) {
        const std::string name = e->d_name;
        if (name.size() > base.size() + 5 && name.rfind(base + ".", 0) == 0 &&
            name.compare(name.size() - 4, 4, ".seg") == 0) {
          unlink((dir + name).c_str());
        }
      }
      closedir(d);
    }
  }
  im.listen_fd =
      socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (im.listen_fd < 0 ||
      bind(im.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(im.listen_fd, 64) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "shm: cannot listen on '", path, "': ", std::strerror(errno)));
  }
  im.bound = true;  // from here on the socket file is ours to remove
  // Engines in another container of the pod connect as the pod's fsGroup
  // (or --shm_group): owner and group may connect, others not.
  const int64_t group = server->options_.group;
  if (group >= 0 && chown(path.c_str(), static_cast<uid_t>(-1),
                          static_cast<gid_t>(group)) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shm: cannot give '", path, "' to group ", group, ": ",
        std::strerror(errno)));
  }
  chmod(path.c_str(), 0660);
  im.epfd = epoll_create1(EPOLL_CLOEXEC);
  im.waker->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (im.epfd < 0 || im.waker->efd < 0) {
    return absl::InternalError(absl::StrCat("shm: epoll/eventfd: ", std::strerror(errno)));
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
    if (a->attached && !a->dead) im.Detach(*a, "leapd is stopping", false, "stopping");
  }
  im.attachments.clear();
  if (im.listen_fd >= 0) close(im.listen_fd);
  if (im.bound) unlink(options_.path.c_str());
  if (im.epfd >= 0) close(im.epfd);
}

// ------------------------------------------------------------- the loop

void ShmServer::Impl::Loop() {
  tls_shm_thread = true;
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
      if (a->attached && !a->dead) busy |= Service(*a);
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
      for (const auto& [key, a] : attachments) unattached |= !a->attached && !a->dead;
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
      Attachment& a = *cur->second;
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
    const int fd = accept4(listen_fd, nullptr, nullptr,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
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
    auto a = std::make_shared<Attachment>();
    a->accepted_ns = NowNs();
    a->sock = fd;
    a->waker = waker;
    const uint64_t key = next_key++;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = Tag(key, 2);
    epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
    attachments[key] = a;
  }
}

void ShmServer::Impl::OnSocket(const std::shared_ptr<Attachment>& a) {
  if (a->dead) return;
  if (!a->attached) {
    HandleAttach(a);
    return;
  }
  // An attached engine only ever hangs up.
  char buf[256];
  const ssize_t n = recv(a->sock, buf, sizeof(buf), MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
    Detach(*a, "engine hung up", false, "hangup");
  }
}

void ShmServer::Impl::Refuse(Attachment& a, const absl::Status& s) {
  core->metrics().shm_refused().Increment();
  shm::AttachReply reply{};
  reply.magic = shm::kMagic;
  reply.format_version = shm::kFormatVersion;
  reply.code = static_cast<int32_t>(s.code());
  const std::string text(s.message());
  reply.body_bytes = static_cast<uint32_t>(text.size());
  std::string packet(reinterpret_cast<const char*>(&reply), sizeof(reply));
  packet += text;
  shm::SendPacket(a.sock, packet, {}).IgnoreError();
  std::fprintf(stderr, "leapd: shm attach refused: %s\n", text.c_str());
  a.dead = true;
}

void ShmServer::Impl::HandleAttach(const std::shared_ptr<Attachment>& a) {
  std::string packet;
  std::vector<int> fds;
  absl::Status s = shm::ReceivePacket(a->sock, &packet, &fds, shm::kMaxAttachPacket);
  for (int fd : fds) close(fd);  // an engine never sends fds
  if (absl::IsDeadlineExceeded(s)) return;  // nothing to read yet
  if (!s.ok()) {
    a->dead = true;  // hung up (or failed) before attaching
    return;
  }
  s = Attach(*a, packet);
  if (!s.ok()) Refuse(*a, s);
}

absl::Status ShmServer::Impl::Attach(Attachment& a, const std::string& packet) {
  shm::AttachRequest req;
  if (packet.size() < sizeof(req)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attach request of ", packet.size(), " bytes is shorter than its head (",
        sizeof(req), ")"));
  }
  std::memcpy(&req, packet.data(), sizeof(req));
  if (req.magic != shm::kMagic) {
    return absl::InvalidArgumentError("attach request has a bad magic number");
  }
  if (req.format_version != shm::kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm format version mismatch: leapd speaks ", shm::kFormatVersion,
        ", the engine ", req.format_version));
  }
  if (!core->serving()) {
    return absl::UnavailableError(
        "leapd is recovering (replaying its feedback log); attach again "
        "shortly");
  }
  if (req.hello_bytes != packet.size() - sizeof(req)) {
    return absl::InvalidArgumentError("attach request: hello length mismatch");
  }
  pb::EngineMessage m;
  if (!m.ParseFromArray(packet.data() + sizeof(req), req.hello_bytes) ||
      !m.has_hello()) {
    return absl::InvalidArgumentError("attach request carries no valid hello");
  }
  a.hello = m.hello();
  ASSIGN_OR_RETURN(a.dtype, CheckHello(a.hello));
  RETURN_IF_ERROR(CheckHelloIdentity(*core, a.hello));
  if (a.hello.dim() != req.dim ||
      static_cast<uint32_t>(a.hello.dtype()) != req.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attach request dim/dtype (", req.dim, "/", req.dtype,
        ") differ from its hello (", a.hello.dim(), "/",
        static_cast<int>(a.hello.dtype()), ")"));
  }
  if (req.slots > options.max_slots) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine asks for ", req.slots, " slots; this leapd allows at most ",
        options.max_slots, " (--shm_max_slots)"));
  }
  if (req.ring_bytes > options.max_ring_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine asks for rings of ", req.ring_bytes, " bytes; at most ",
        options.max_ring_bytes));
  }
  int attached_now = 0;
  for (auto& [k, other] : attachments) attached_now += other->attached && !other->dead;
  if (attached_now >= options.max_engines) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "leapd already serves ", attached_now, " engines over shm (max ",
        options.max_engines, ")"));
  }
  {
    bool width_served = false;
    std::string widths;
    for (const auto& r : core->ListReadouts()) {
      if (r->spec().dim == req.dim) width_served = true;
      absl::StrAppend(&widths, widths.empty() ? "" : ", ", r->name(), "=",
                      r->spec().dim);
    }
    if (!width_served) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no readout takes dim ", req.dim, " features (readouts: ",
          widths.empty() ? "none" : widths, ")"));
    }
  }
  ASSIGN_OR_RETURN(a.layout, shm::ComputeLayout(req.dim, req.dtype, req.slots,
                                                req.ring_bytes));
  a.attach_id = rng();
  a.seg_path = absl::StrFormat("%s.%016x.seg", options.path, a.attach_id);
  const int fd = open(a.seg_path.c_str(),
                      O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot create segment '", a.seg_path, "': ", std::strerror(errno)));
  }
  auto fail = [&](const char* what) {
    const absl::Status s = absl::UnavailableError(absl::StrCat(
        what, " segment '", a.seg_path, "' of ", a.layout.total_bytes,
        " bytes: ", std::strerror(errno)));
    close(fd);
    unlink(a.seg_path.c_str());
    a.seg_path.clear();
    return s;
  };
  if (options.group >= 0 &&
      (fchown(fd, static_cast<uid_t>(-1), static_cast<gid_t>(options.group)) != 0 ||
       fchmod(fd, 0660) != 0)) {
    return fail("cannot give the group access to");
  }
  if (ftruncate(fd, static_cast<off_t>(a.layout.total_bytes)) != 0) {
    return fail("cannot size");
  }
  void* base = mmap(nullptr, a.layout.total_bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail("cannot map");
  a.mapping = std::make_shared<Mapping>(a.layout.slot_count);
  a.mapping->base = base;
  a.mapping->bytes = a.layout.total_bytes;
  a.mapping->waker = waker;
  shm::InitHeader(base, a.layout, a.attach_id);
  a.hdr = static_cast<shm::SegmentHeader*>(base);
  char* b = static_cast<char*>(base);
  a.in = shm::Ring(&a.hdr->to_sidecar, b + a.layout.to_sidecar_offset,
                   a.layout.ring_bytes);
  a.out = shm::Ring(&a.hdr->to_engine, b + a.layout.to_engine_offset,
                    a.layout.ring_bytes);
  a.held.assign(a.layout.slot_count, 0);
  a.by_slot.assign(a.layout.slot_count, {});
  a.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (a.efd < 0) return fail("no eventfd for");

  a.session = next_session->fetch_add(1);
  pb::SidecarMessage ack;
  ack.set_seq(m.seq());
  // Each attachment is its own holder of features: after a reattach the
  // engine's client sees a new id and resubmits its live requests.
  ack.mutable_hello_ack()->set_sidecar_id(
      absl::StrFormat("%s/shm-%016x", sidecar_id, a.attach_id));
  ack.mutable_hello_ack()->set_max_batch_bytes(core->options().max_batch_bytes);
  shm::AttachReply reply{};
  reply.magic = shm::kMagic;
  reply.format_version = shm::kFormatVersion;
  reply.attach_id = a.attach_id;
  reply.segment_bytes = a.layout.total_bytes;
  const std::string body = ack.SerializeAsString();
  reply.body_bytes = static_cast<uint32_t>(body.size());
  std::string out(reinterpret_cast<const char*>(&reply), sizeof(reply));
  out += body;
  absl::Status sent = shm::SendPacket(a.sock, out, {fd, a.efd});
  close(fd);
  if (!sent.ok()) {
    unlink(a.seg_path.c_str());
    a.dead = true;
    return absl::OkStatus();  // nobody to tell
  }
  uint64_t key = 0;
  for (auto& [k, v] : attachments) {
    if (v.get() == &a) key = k;
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = Tag(key, 3);
  epoll_ctl(epfd, EPOLL_CTL_ADD, a.efd, &ev);
  a.attached = true;
  core->hub().Subscribe(attachments[key]);
  core->metrics().connected_engines().Increment();
  std::printf("shm: engine '%s' attached: %lld slots, dim %lld %s, segment %s\n",
              a.hello.engine_id().c_str(), static_cast<long long>(a.layout.slot_count),
              static_cast<long long>(a.layout.dim),
              std::string(readout::DTypeName(a.dtype)).c_str(), a.seg_path.c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

void ShmServer::Impl::Detach(Attachment& a, const std::string& why,
                             bool corrupt, const char* label) {
  if (a.dead) return;
  a.dead = true;
  if (!a.attached) return;
  if (corrupt) {
    std::fprintf(stderr, "leapd: shm engine '%s' detached: %s\n",
                 a.hello.engine_id().c_str(), why.c_str());
    shm::AttachReply reply{};
    reply.magic = shm::kMagic;
    reply.format_version = shm::kFormatVersion;
    reply.code = static_cast<int32_t>(absl::StatusCode::kDataLoss);
    reply.body_bytes = static_cast<uint32_t>(why.size());
    std::string packet(reinterpret_cast<const char*>(&reply), sizeof(reply));
    packet += why;
    shm::SendPacket(a.sock, packet, {}).IgnoreError();
  }
  // The engine is gone: its live requests can never complete. Cancelling
  // them drops their slot leases; the mapping goes with the last one.
  int64_t reclaimed = 0;
  for (const auto& r : a.Live()) {
    if (r->session != a.session) continue;
    if (core->CancelExact(*r)) ++reclaimed;
  }
  a.by_slot.clear();
  a.inline_live.clear();
  core->metrics().shm_reclaimed().Increment(static_cast<double>(reclaimed));
  core->metrics().ShmDetached(label).Increment();
  a.hdr->sidecar_closed.store(1);
  a.hdr->to_engine.wake.fetch_add(1);
  shm::FutexWakeAll(&a.hdr->to_engine.wake);
  unlink(a.seg_path.c_str());
  epoll_ctl(epfd, EPOLL_CTL_DEL, a.sock, nullptr);
  epoll_ctl(epfd, EPOLL_CTL_DEL, a.efd, nullptr);
  core->metrics().connected_engines().Decrement();
  // Lifecycle lines go to stdout beside "listening on" (tests and operators
  // wait on them).
  std::printf("shm: engine '%s' detached (%s); %lld live requests reclaimed\n",
              a.hello.engine_id().c_str(), why.c_str(),
              static_cast<long long>(reclaimed));
  std::fflush(stdout);
}

// ------------------------------------------------------------ servicing

bool ShmServer::Impl::Service(Attachment& a) {
  bool busy = false;
  if (FlushPending(a)) {
    std::string error;
    for (int frames = 0; frames < 64; ++frames) {
      shm::FrameHeader h;
      const char* payload;
      const shm::Ring::Peek p = a.in.Next(&h, &payload, &error);
      if (p == shm::Ring::Peek::kEmpty) break;
      if (p == shm::Ring::Peek::kCorrupt) {
        Detach(a, "corrupt engine->sidecar ring: " + error, true, "corrupt");
        return true;
      }
      switch (static_cast<FrameKind>(h.kind)) {
        case FrameKind::kFeatures:
          HandleFeatures(a, payload, h.bytes);
          break;
        case FrameKind::kProto:
          HandleProto(a, payload, h.bytes);
          break;
        case FrameKind::kCancels:
          HandleCancels(a, payload, h.bytes);
          break;
        default: {
          pb::SidecarMessage m;
          m.mutable_error()->set_code(
              static_cast<int>(absl::StatusCode::kInvalidArgument));
          m.mutable_error()->set_message(
              absl::StrCat("unknown shm frame kind ", h.kind));
          EmitProto(a, m);
        }
      }
      a.in.Pop();
      busy = true;
      // Hand answers and freed slots over after every frame: the engine
      // refills while leapd works on the next frames (no idle gap waiting
      // for the engine's reaction at the end of a long round).
      FlushReleases(a);
      if (a.out_dirty) Publish(a);
      if (!a.pending.empty()) break;  // the engine is not reading: wait
    }
    if (busy) a.in.ReleaseConsumed();
  }
  FlushReleases(a);
  if (a.has_publish.load(std::memory_order_relaxed)) FlushPublishes(a);
  if (a.pending_bytes > kMaxPendingBytes) {
    // An engine that stopped reading (hung, or its ring's head is garbage):
    // do not buffer for it without bound.
    Detach(a,
           absl::StrCat("the engine stopped reading its ring: ", a.pending_bytes,
                        " bytes of answers pending"),
           true, "stalled");
    return true;
  }
  if (a.out_dirty) {
    Publish(a);
    busy = true;
  }
  return busy;
}

void ShmServer::Impl::Publish(Attachment& a) {
  a.out_dirty = false;
  if (a.out.Publish()) {
    a.hdr->to_engine.wake.fetch_add(1, std::memory_order_relaxed);
    shm::FutexWakeAll(&a.hdr->to_engine.wake);
  }
}

void ShmServer::Impl::Emit(Attachment& a, FrameKind kind, const std::string& bytes) {
  if (bytes.size() > a.out.max_payload()) {
    // Never queue what the ring can never take (it would stall the engine):
    // answer with a short message-level error instead.
    pb::SidecarMessage m;
    if (kind == FrameKind::kProto) {
      pb::SidecarMessage big;
      if (big.ParseFromString(bytes)) m.set_seq(big.seq());
    }
    m.mutable_error()->set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
    m.mutable_error()->set_message(absl::StrCat(
        "the answer (", bytes.size(), " bytes) does not fit this engine's ring (",
        a.out.max_payload(), " bytes per frame): send fewer records per message "
        "or attach with larger rings"));
    core->metrics().RequestErrors("RESOURCE_EXHAUSTED").Increment();
    Emit(a, FrameKind::kProto, m.SerializeAsString());
    return;
  }
  EmitParts(a, kind, {bytes});
}

void ShmServer::Impl::EmitParts(Attachment& a, FrameKind kind,
                                std::initializer_list<absl::string_view> parts) {
  size_t n = 0;
  for (absl::string_view p : parts) n += p.size();
  if (a.pending.empty()) {
    if (char* out = a.out.Reserve(n, kind)) {
      for (absl::string_view p : parts) {
        std::memcpy(out, p.data(), p.size());
        out += p.size();
      }
      a.out.Commit();
      a.out_dirty = true;
      return;
    }
  }
  std::string frame;
  frame.reserve(n);
  for (absl::string_view p : parts) frame.append(p.data(), p.size());
  a.pending_bytes += frame.size();
  a.pending.emplace_back(kind, std::move(frame));
}

void ShmServer::Impl::EmitProto(Attachment& a, const pb::SidecarMessage& m) {
  Emit(a, FrameKind::kProto, m.SerializeAsString());
}

bool ShmServer::Impl::FlushPending(Attachment& a) {
  while (!a.pending.empty()) {
    auto& [kind, bytes] = a.pending.front();
    char* p = a.out.Reserve(bytes.size(), kind);
    if (p == nullptr) {
      if (a.out_dirty) Publish(a);
      return false;
    }
    std::memcpy(p, bytes.data(), bytes.size());
    a.out.Commit();
    a.out_dirty = true;
    a.pending_bytes -= bytes.size();
    a.pending.pop_front();
  }
  return true;
}

void ShmServer::Impl::HandleFeatures(Attachment& a, const char* payload,
                                     size_t bytes) {
  shm::FeaturesReader reader(payload, bytes);
  uint64_t seq = 0;
  uint32_t count = 0;
  Metrics& metrics = core->metrics();
  auto frame_error = [&](const absl::Status& s) {
    pb::SidecarMessage m;
    m.set_seq(seq);
    m.mutable_error()->set_code(static_cast<int>(s.code()));
    m.mutable_error()->set_message(std::string(s.message()));
    metrics.RequestErrors(absl::StatusCodeToString(s.code())).Increment();
    EmitProto(a, m);
  };
  if (absl::Status s = reader.Init(&seq, &count); !s.ok()) {
    frame_error(s);
    return;
  }
  const size_t feature_bytes =
      static_cast<size_t>(a.layout.dim) * a.layout.dtype_size;
  const size_t max_payload = a.out.max_payload();
  uint32_t n_pred = 0, n_err = 0;
  std::string& preds = scratch_p;
  std::string& errs = scratch_e;
  preds.clear();
  errs.clear();
  auto flush = [&] {
    const shm::PredictionsHead head{seq, n_pred, n_err};
    EmitParts(a, FrameKind::kPredictions,
              {absl::string_view(reinterpret_cast<const char*>(&head), sizeof(head)),
               preds, errs});
    preds.clear();
    errs.clear();
    n_pred = n_err = 0;
  };
  auto add_error = [&](uint32_t slot, absl::string_view id,
                       const absl::Status& s) {
    // Bounded echo (as gRPC's up to 4 KiB ids; longer ones name no live
    // request anyway), the message too, so a record always fits a frame of
    // the smallest ring.
    id = id.substr(0, 4096);
    const std::string msg(s.message().substr(0, 1024));
    const size_t need = shm::ErrorRecordBytes(id.size(), msg.size());
    if (sizeof(shm::PredictionsHead) + preds.size() + errs.size() + need >
        max_payload) {
      flush();
    }
    const size_t at = errs.size();
    errs.resize(at + need);
    shm::WriteErrorRecord(errs.data() + at, slot, id, static_cast<int>(s.code()),
                          msg);
    ++n_err;
    metrics.RequestErrors(absl::StatusCodeToString(s.code())).Increment();
  };
  // First pass: decode and check slots; then one PredictBatch; then the
  // answers in record order.
  records_.clear();
  reqs_.clear();
  for (uint32_t i = 0; i < count; ++i) {
    shm::FeatureRecordView rec;
    if (absl::Status s = reader.Next(&rec); !s.ok()) {
      // Nothing of this frame is scored: give back the slots taken so far.
      for (const ScoreRequest& r : reqs_) a.mapping->Release(r.external_slot);
      reqs_.clear();
      frame_error(s);
      return;
    }
    int req = -1;
    if (rec.slot < a.layout.slot_count && !a.held[rec.slot]) {
      a.held[rec.slot] = 1;
      ScoreRequest sr;
      sr.request_id = rec.request_id;
      sr.instance = a.hello.instance_id();
      sr.product_line = rec.product_line;
      sr.features = absl::string_view(a.Slot(rec.slot), feature_bytes);
      sr.dtype = a.dtype;
      sr.request_max_tokens = rec.max_tokens;
      sr.external_owner = a.mapping;
      sr.external_slot = rec.slot;
      req = static_cast<int>(reqs_.size());
      reqs_.push_back(std::move(sr));
    }
    records_.emplace_back(rec, req);
  }
  core->PredictBatch(reqs_, a.session, &results_, &lives_);
  reqs_.clear();
  for (size_t k = 0; k < records_.size(); ++k) {
    const auto& [rec, req] = records_[k];
    if (req < 0) {
      add_error(rec.slot, rec.request_id,
                rec.slot >= a.layout.slot_count
                    ? absl::InvalidArgumentError(absl::StrCat(
                          "slot index ", rec.slot, " is out of range [0, ",
                          a.layout.slot_count, ")"))
                    : absl::InvalidArgumentError(absl::StrCat(
                          "slot ", rec.slot,
                          " is still held by leapd for a live request; wait "
                          "for its release before reusing it")));
      continue;
    }
    const absl::StatusOr<ScoreResult>& s = results_[req];
    if (!s.ok()) {
      add_error(rec.slot, rec.request_id, s.status());
      continue;
    }
    std::shared_ptr<LiveRequest>& live = lives_[req];
    const size_t need = shm::PredictionRecordBytes(
        rec.request_id.size(), std::min<size_t>(s->readout.size(), 255),
        std::min<size_t>(s->arm.size(), 255));
    if (sizeof(shm::PredictionsHead) + preds.size() + errs.size() + need >
        max_payload) {
      flush();
    }
    const size_t at = preds.size();
    preds.resize(at + need);
    shm::WritePredictionRecord(
        preds.data() + at, rec.slot, live->request_id,
        absl::string_view(s->readout).substr(0, 255),
        absl::string_view(s->arm).substr(0, 255), s->predicted_tokens, s->score,
        s->version);
    ++n_pred;
    a.Track(std::move(live));
  }
  lives_.clear();
  results_.clear();
  flush();
}

void ShmServer::Impl::HandleProto(Attachment& a, const char* payload,
                                  size_t bytes) {
  pb::EngineMessage in;
  pb::SidecarMessage out;
  if (!in.ParseFromArray(payload, static_cast<int>(bytes))) {
    out.mutable_error()->set_code(
        static_cast<int>(absl::StatusCode::kInvalidArgument));
    out.mutable_error()->set_message(
        absl::StrCat("malformed EngineMessage frame of ", bytes, " bytes"));
    core->metrics().RequestErrors("INVALID_ARGUMENT").Increment();
  } else {
    HandleEngineMessage(core, a.session, a.hello, a.dtype, &in, &out, &a);
    FitAnswer(&out, a.out.max_payload());
  }
  EmitProto(a, out);
}

void ShmServer::Impl::HandleCancels(Attachment& a, const char* payload,
                                    size_t bytes) {
  pb::SidecarMessage out;
  shm::CancelsHead head{};
  std::vector<absl::string_view>& ids = cancel_ids_;
  ids.clear();
  bool ok = bytes >= sizeof(head);
  if (ok) {
    std::memcpy(&head, payload, sizeof(head));
    size_t at = sizeof(head);
    for (uint32_t i = 0; i < head.count && ok; ++i) {
      uint16_t len;
      if (bytes - at < sizeof(len)) {
        ok = false;
        break;
      }
      std::memcpy(&len, payload + at, sizeof(len));
      at += sizeof(len);
      if (bytes - at < len) {
        ok = false;
        break;
      }
      ids.emplace_back(payload + at, len);
      at += len;
    }
  }
  out.set_seq(head.seq);
  if (!ok) {
    out.mutable_error()->set_code(
        static_cast<int>(absl::StatusCode::kInvalidArgument));
    out.mutable_error()->set_message(absl::StrCat(
        "cancels frame of ", bytes, " bytes overruns itself (", head.count,
        " ids claimed); nothing cancelled"));
    core->metrics().RequestErrors("INVALID_ARGUMENT").Increment();
  } else {
    CancelRequests(core, ids, out.mutable_ack(), &a, a.hello.instance_id());
    FitAnswer(&out, a.out.max_payload());
  }
  EmitProto(a, out);
}

void ShmServer::Impl::FlushReleases(Attachment& a) {
  std::vector<uint32_t>& slots = released_;
  slots.clear();
  a.mapping->Drain(&slots);
  if (slots.empty()) return;
  const size_t per_frame =
      (a.out.max_payload() - sizeof(shm::ReleaseHead)) / sizeof(uint32_t);
  for (size_t i = 0; i < slots.size(); i += per_frame) {
    const size_t n = std::min(per_frame, slots.size() - i);
    shm::ReleaseHead head{static_cast<uint32_t>(n), 0};
    std::string frame(reinterpret_cast<const char*>(&head), sizeof(head));
    frame.append(reinterpret_cast<const char*>(slots.data() + i),
                 n * sizeof(uint32_t));
    for (size_t j = i; j < i + n; ++j) a.held[slots[j]] = 0;
    Emit(a, FrameKind::kRelease, frame);
  }
}

void ShmServer::Impl::FlushPublishes(Attachment& a) {
  a.has_publish.store(false);
  std::vector<std::pair<std::string, int64_t>> published;
  std::unordered_map<std::string, std::shared_ptr<const PublishedVersion>> rescore;
  {
    absl::MutexLock lock(&a.pub_mu);
    published.swap(a.published);
    rescore.swap(a.rescore);
  }
  for (const auto& [name, version] : published) {
    pb::SidecarMessage m;
    m.mutable_published()->set_readout(name);
    m.mutable_published()->set_version(version);
    EmitProto(a, m);
  }
  for (const auto& [name, v] : rescore) {
    std::vector<std::shared_ptr<LiveRequest>> mine = a.Live();
    std::vector<pb::Prediction> predictions;
    RescorePredictions(name, *v, mine, &predictions);
    mine.clear();
    pb::SidecarMessage m;
    m.mutable_rescore()->set_readout(name);
    m.mutable_rescore()->set_version(v->version);
    const size_t limit = a.out.max_payload() - 1024;
    size_t size = 0;
    for (auto& p : predictions) {
      const size_t add = p.ByteSizeLong() + 8;
      if (size + add > limit && m.rescore().predictions_size() > 0) {
        EmitProto(a, m);
        m.mutable_rescore()->clear_predictions();
        size = 0;
      }
      *m.mutable_rescore()->add_predictions() = std::move(p);
      size += add;
    }
    if (m.rescore().predictions_size() > 0) EmitProto(a, m);
  }
}

}  // namespace leap::sidecar
