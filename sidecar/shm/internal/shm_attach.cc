#include "sidecar/shm/internal/shm_attach.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/shm_format.h"
#include "common/status_macros.h"
#include "sidecar/core/engine_messages.h"

namespace leap::sidecar::shm_internal {

namespace pb = ::leap::v1;

absl::Status BindAttachSocket(const ShmServerOptions& options, int* listen_fd,
                              bool* bound) {
  const std::string& path = options.path;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  // A socket file left by a dead leapd is replaced; a live one is not.
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("shm: '", path,
                       "' exists and is not a socket; refusing to replace it"));
    }
    int probe = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    const bool live =
        connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(probe);
    if (live) {
      return absl::FailedPreconditionError(
          absl::StrCat("shm: another leapd is serving '", path, "'"));
    }
    unlink(path.c_str());
  }
  // Segments of a dead leapd's engines.
  {
    const size_t slash = path.rfind('/');
    const std::string dir =
        slash == std::string::npos ? "." : path.substr(0, slash + 1);
    const std::string base =
        slash == std::string::npos ? path : path.substr(slash + 1);
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
  *listen_fd =
      socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (*listen_fd < 0 ||
      bind(*listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(*listen_fd, 64) != 0) {
    return absl::UnavailableError(absl::StrCat("shm: cannot listen on '", path,
                                               "': ", std::strerror(errno)));
  }
  *bound = true;  // from here on the socket file is ours to remove
  // Engines in another container of the pod connect as the pod's fsGroup
  // (or --shm_group): owner and group may connect, others not.
  const int64_t group = options.group;
  if (group >= 0 && chown(path.c_str(), static_cast<uid_t>(-1),
                          static_cast<gid_t>(group)) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("shm: cannot give '", path,
                                                    "' to group ", group, ": ",
                                                    std::strerror(errno)));
  }
  chmod(path.c_str(), 0660);
  return absl::OkStatus();
}

absl::Status AttachEngine(const AttachContext& ctx, const std::string& packet,
                          ShmSession* a) {
  shm::AttachRequest req;
  if (packet.size() < sizeof(req)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attach request of ", packet.size(),
                     " bytes is shorter than its head (", sizeof(req), ")"));
  }
  std::memcpy(&req, packet.data(), sizeof(req));
  if (req.magic != shm::kMagic) {
    return absl::InvalidArgumentError("attach request has a bad magic number");
  }
  if (req.format_version != shm::kFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm format version mismatch: leapd speaks ",
                     shm::kFormatVersion, ", the engine ", req.format_version));
  }
  if (!ctx.core->serving()) {
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
  a->hello = m.hello();
  ASSIGN_OR_RETURN(a->dtype, CheckHello(a->hello));
  RETURN_IF_ERROR(CheckHelloIdentity(*ctx.core, a->hello));
  if (a->hello.dim() != req.dim ||
      static_cast<uint32_t>(a->hello.dtype()) != req.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("attach request dim/dtype (", req.dim, "/", req.dtype,
                     ") differ from its hello (", a->hello.dim(), "/",
                     static_cast<int>(a->hello.dtype()), ")"));
  }
  if (req.slots > ctx.options->max_slots) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine asks for ", req.slots, " slots; this leapd allows at most ",
        ctx.options->max_slots, " (--shm_max_slots)"));
  }
  if (req.ring_bytes > ctx.options->max_ring_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("engine asks for rings of ", req.ring_bytes,
                     " bytes; at most ", ctx.options->max_ring_bytes));
  }
  const int attached_now = ctx.attached_now;
  if (attached_now >= ctx.options->max_engines) {
    return absl::ResourceExhaustedError(
        absl::StrCat("leapd already serves ", attached_now,
                     " engines over shm (max ", ctx.options->max_engines, ")"));
  }
  {
    bool width_served = false;
    std::string widths;
    for (const auto& r : ctx.core->ListReadouts()) {
      if (r->spec().dim == req.dim) width_served = true;
      absl::StrAppend(&widths, widths.empty() ? "" : ", ", r->name(), "=",
                      r->spec().dim);
    }
    if (!width_served) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no readout takes dim ", req.dim,
          " features (readouts: ", widths.empty() ? "none" : widths, ")"));
    }
  }
  ASSIGN_OR_RETURN(a->layout, shm::ComputeLayout(req.dim, req.dtype, req.slots,
                                                 req.ring_bytes));
  a->attach_id = (*ctx.rng)();
  a->seg_path =
      absl::StrFormat("%s.%016x.seg", ctx.options->path, a->attach_id);
  const int fd =
      open(a->seg_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot create segment '", a->seg_path, "': ", std::strerror(errno)));
  }
  auto fail = [&](const char* what) {
    const absl::Status s = absl::UnavailableError(
        absl::StrCat(what, " segment '", a->seg_path, "' of ",
                     a->layout.total_bytes, " bytes: ", std::strerror(errno)));
    close(fd);
    unlink(a->seg_path.c_str());
    a->seg_path.clear();
    return s;
  };
  if (ctx.options->group >= 0 &&
      (fchown(fd, static_cast<uid_t>(-1),
              static_cast<gid_t>(ctx.options->group)) != 0 ||
       fchmod(fd, 0660) != 0)) {
    return fail("cannot give the group access to");
  }
  if (ftruncate(fd, static_cast<off_t>(a->layout.total_bytes)) != 0) {
    return fail("cannot size");
  }
  void* base = mmap(nullptr, a->layout.total_bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail("cannot map");
  a->mapping = std::make_shared<Mapping>(a->layout.slot_count);
  a->mapping->base = base;
  a->mapping->bytes = a->layout.total_bytes;
  a->mapping->waker = a->waker;
  shm::InitHeader(base, a->layout, a->attach_id);
  a->hdr = static_cast<shm::SegmentHeader*>(base);
  char* b = static_cast<char*>(base);
  a->in = shm::Ring(&a->hdr->to_sidecar, b + a->layout.to_sidecar_offset,
                    a->layout.ring_bytes);
  a->out = shm::Ring(&a->hdr->to_engine, b + a->layout.to_engine_offset,
                     a->layout.ring_bytes);
  a->held.assign(a->layout.slot_count, 0);
  a->by_slot.assign(a->layout.slot_count, {});
  a->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (a->efd < 0) return fail("no eventfd for");

  a->session = ctx.next_session->fetch_add(1);
  pb::SidecarMessage ack;
  ack.set_seq(m.seq());
  // Each attachment is its own holder of features: after a reattach the
  // engine's client sees a new id and resubmits its live requests.
  ack.mutable_hello_ack()->set_sidecar_id(
      absl::StrFormat("%s/shm-%016x", *ctx.sidecar_id, a->attach_id));
  ack.mutable_hello_ack()->set_max_batch_bytes(
      ctx.core->options().max_batch_bytes);
  shm::AttachReply reply{};
  reply.magic = shm::kMagic;
  reply.format_version = shm::kFormatVersion;
  reply.attach_id = a->attach_id;
  reply.segment_bytes = a->layout.total_bytes;
  const std::string body = ack.SerializeAsString();
  reply.body_bytes = static_cast<uint32_t>(body.size());
  std::string out(reinterpret_cast<const char*>(&reply), sizeof(reply));
  out += body;
  absl::Status sent = shm::SendPacket(a->sock, out, {fd, a->efd});
  close(fd);
  if (!sent.ok()) {  // nobody to tell
    unlink(a->seg_path.c_str());
    a->dead = true;
  }
  return absl::OkStatus();
}

void Refuse(Core& core, ShmSession* a, const absl::Status& s) {
  core.metrics().shm_refused().Increment();
  const std::string text(s.message());
  SendAttachError(a->sock, s.code(), text);
  std::fprintf(stderr, "leapd: shm attach refused: %s\n", text.c_str());
  a->dead = true;
}

void SendAttachError(int sock, absl::StatusCode code, absl::string_view text) {
  shm::AttachReply reply{};
  reply.magic = shm::kMagic;
  reply.format_version = shm::kFormatVersion;
  reply.code = static_cast<int32_t>(code);
  reply.body_bytes = static_cast<uint32_t>(text.size());
  std::string packet(reinterpret_cast<const char*>(&reply), sizeof(reply));
  packet.append(text.data(), text.size());
  shm::SendPacket(sock, packet, {}).IgnoreError();
}

}  // namespace leap::sidecar::shm_internal
