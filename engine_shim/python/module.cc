// leap_shim: the engine shim for Python engines (docs/ARCHITECTURE.md), a
// thin layer over leap::shim's Client, capture functions and
// CountdownScheduler; tensors come in through DLPack (dlpack_import.h), so no
// torch is linked and one build serves engines pinned to any torch version.
//
// This file only registers the module (classes, functions, docstrings). The
// work is in py_client.h (leap_shim.Client), py_scheduler.h
// (leap_shim.Scheduler) and py_convert.h (absl::Status to Python exceptions,
// option strings to enums).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "engine_shim/capture.h"
#include "engine_shim/client.h"
#include "engine_shim/python/py_client.h"
#include "engine_shim/python/py_convert.h"
#include "engine_shim/python/py_scheduler.h"
#include "engine_shim/scheduler.h"

PYBIND11_MODULE(leap_shim, m) {
  namespace py = pybind11;
  using leap::shim::Event;
  using namespace leap::shim::python;  // NOLINT: the binding's own names

  m.doc() = R"doc(LEAP engine shim for Python engines (vLLM, SGLang, ...).

Ships the hidden state of each request's last prompt token to leapd, which
predicts the request's output length; feeds the predictions to a countdown
scheduler that picks the requests of each decode step; reports how each
request ended so leapd keeps learning.

  client = leap_shim.Client("unix:///run/leapd.sock", dim=4096, dtype="bfloat16")
  sched = leap_shim.Scheduler(slots=64)
  sched.add(rid)                                  # request admitted
  client.capture(hidden[:, -1, :], [rid])         # at prefill, layer L
  events = client.poll(); sched.apply(events)     # every decode step
  batch = sched.select()                          # ids that decode now
  client.complete(rid, n_tokens, "stop"); sched.remove(rid)

Tensors come in through DLPack (__dlpack__): torch, numpy, CuPy, JAX, ...
This module links no torch, so it works with whatever torch the engine pins.
Errors: ValueError / TypeError for bad arguments, KeyError for unknown
request ids in the Scheduler, RuntimeError for everything else.)doc";
  m.attr("__version__") = LEAP_VERSION_STRING;

  m.def(
      "cuda_capture_available", &leap::shim::CudaCaptureAvailable,
      R"doc(True when this build has the CUDA capture path and a CUDA device is
visible; otherwise Client.capture accepts only CPU tensors.)doc");

  py::class_<Event>(m, "Event",
                    R"doc(Something leapd said, delivered by Client.poll().

Attributes (read-only):
  kind: 'prediction' (first prediction of a request), 'rescore' (a new
    readout version re-predicted a live request), 'error' (a request or the
    connection failed; see code/message), 'connected' (message = the
    sidecar's id), 'disconnected', or 'prior' (a length prior asked by
    request_priors: predicted_tokens).
  request_id: the request ('' for connection events and stream errors).
  predicted_tokens: predicted output length L-hat in tokens (prediction,
    rescore), or the prior (prior).
  score: the readout's raw score (prediction, rescore).
  readout: the readout that predicted (prediction, rescore).
  version: that readout's version (prediction, rescore).
  code: google.rpc code of an error (3 INVALID_ARGUMENT, 5 NOT_FOUND, ...).
  message: error text, or the sidecar id of a 'connected' event.)doc")
      .def(
          py::init([](const std::string& kind, std::string request_id,
                      double predicted_tokens, double score,
                      std::string readout, int64_t version, int32_t code,
                      std::string message) {
            Event e;
            e.kind = ParseKind(kind);
            e.request_id = std::move(request_id);
            e.predicted_tokens = predicted_tokens;
            e.score = score;
            e.readout = std::move(readout);
            e.version = version;
            e.code = code;
            e.message = std::move(message);
            return e;
          }),
          py::arg("kind"), py::arg("request_id") = "",
          py::arg("predicted_tokens") = 0.0, py::arg("score") = 0.0,
          py::arg("readout") = "", py::arg("version") = 0, py::arg("code") = 0,
          py::arg("message") = "",
          R"doc(Builds an event by hand (replays, simulators, tests); the client
makes its own.)doc")
      .def_property_readonly(
          "kind", [](const Event& e) { return std::string(KindName(e.kind)); },
          "'prediction', 'rescore', 'error', 'connected', 'disconnected' or "
          "'prior'.")
      .def_readonly("request_id", &Event::request_id, "The request's id.")
      .def_readonly("predicted_tokens", &Event::predicted_tokens,
                    "Predicted output length in tokens.")
      .def_readonly("score", &Event::score, "The readout's raw score.")
      .def_readonly("readout", &Event::readout, "Name of the readout.")
      .def_readonly("version", &Event::version, "Version of the readout.")
      .def_readonly("code", &Event::code, "google.rpc code of an error.")
      .def_readonly("message", &Event::message,
                    "Error text; the sidecar id for 'connected'.")
      .def("__repr__", &EventRepr);

  py::class_<PyClient>(m, "Client", R"doc(The engine's client of leapd.

Thread-safe and non-blocking: capture/complete/cancel queue their work and a
background thread ships it, keeps the connection alive (reconnecting with
backoff) and, after a sidecar restart, resubmits the features of every live
request and resends unacknowledged completions. Results arrive as events
through poll(). Usable as a context manager (close() on exit).)doc")
      .def(py::init<std::string, int64_t, std::string, std::string, std::string,
                    int32_t, double, double, double, int, int64_t, int64_t,
                    std::string, std::string, std::string, std::string, double,
                    int64_t, int64_t>(),
           py::arg("endpoint"), py::arg("dim"), py::arg("dtype") = "float32",
           py::arg("engine_id") = "", py::arg("model_id") = "",
           py::arg("layer") = -1, py::arg("min_backoff_s") = 0.05,
           py::arg("max_backoff_s") = 5.0, py::arg("connect_timeout_s") = 1.0,
           py::arg("max_batch_records") = 256,
           py::arg("max_live_requests") = 65536,
           py::arg("cuda_staging_bytes") = int64_t{64} << 20,
           py::arg("tls_ca_file") = "", py::arg("tls_cert_file") = "",
           py::arg("tls_key_file") = "", py::arg("instance_id") = "",
           py::arg("response_timeout_s") = 5.0, py::arg("shm_slots") = 1024,
           py::arg("shm_ring_bytes") = 1 << 20,
           R"doc(Starts the client; connecting happens in the background.

Args:
  endpoint: leapd's address, "host:port", "unix:///path/to/socket" or
    "shm:///path/to/leap.shm"; anything else (e.g. "http://host") raises
    ValueError.
  dim: feature width d (the model's hidden size); every captured row must
    have exactly d values.
  dtype: element type shipped to leapd: "float32" (default), "bfloat16" or
    "float16"; captured tensors of another of these types are converted.
  engine_id, model_id, layer: identity shown in leapd's logs and metrics
    (layer = the L whose hidden state is captured); engine_id and model_id
    hold at most 256 bytes each.
  min_backoff_s, max_backoff_s: reconnect backoff, doubling from min to max;
    also spaces the resends of a completion refused UNAVAILABLE.
  connect_timeout_s: how long one connection attempt may take.
  max_batch_records: records per message to leapd.
  max_live_requests: requests kept for resubmission; more are refused with
    an 'error' event (code 8).
  cuda_staging_bytes: pinned host memory per CUDA device for CUDA captures.
  tls_ca_file: gRPC over TCP with TLS (leapd --tls_cert): PEM file of the CA
    that signed leapd's certificate. With it, the client speaks TLS only.
  tls_cert_file, tls_key_file: this engine's PEM certificate chain and key,
    for mutual TLS (leapd --tls_client_ca); together or not at all.
    All three empty (the default): plaintext. leapd's unix sockets are
    plaintext only (leave these empty for unix://); shm:// ignores them.
  instance_id: this engine's instance id (Hello.instance_id, at most 128
    bytes, no NUL): leapd scopes request ids to it, so engines that number
    their requests alike never collide. '' (default): a random 128-bit hex
    id, kept for the client's life (see the instance_id property).
  response_timeout_s: a connection on which a message waited this long for
    its answer, with no answer to an earlier message meanwhile, is abandoned
    as hung; the client reconnects and reports degraded. Every message
    awaiting an answer is watched. Above leapd's NATS publish timeout (2 s:
    in fleet mode a completions answer waits for JetStream). > 0; default
    5.0.
  shm_slots: shm:// only: feature slots; each live request holds one until
    it ends. In [1, 1048576]; default 1024. leapd refuses more than its
    --shm_max_slots.
  shm_ring_bytes: shm:// only: bytes of each message ring, a power of two
    in [65536, 67108864]; default 1048576 (1 MiB).

Raises:
  ValueError: a bad option (dim outside [1, 16384], unknown dtype, a TLS
    file that cannot be read, a certificate without its key, an instance_id
    over 128 bytes, an engine_id or model_id over 256 bytes,
    response_timeout_s <= 0, shm_slots or shm_ring_bytes out of range, ...),
    with a message naming it.)doc")
      .def(
          "capture", &PyClient::Capture, py::arg("tensor"),
          py::arg("request_ids"), py::arg("product_line") = "",
          py::arg("max_tokens") = 0, py::arg("stream") = py::none(),
          R"doc(Ships the hidden states of new requests to leapd for prediction.

Args:
  tensor: [batch, dim] rows, one per request, of float32, bfloat16 or
    float16, on the CPU or a CUDA device, any strides (slices, transposes,
    last-token rows of a packed batch). Anything with __dlpack__ (torch,
    numpy, CuPy, JAX) or a 'dltensor' PyCapsule (consumed: renamed
    'used_dltensor').
  request_ids: one id (str) per row, in row order.
  product_line: routing key of these requests in leapd ('' = default route).
  max_tokens: each request's own output cap (0 = none); an int for all rows
    or one int per row.
  stream: CUDA tensors only, the DLPack stream number of the stream the
    tensor is produced on: an int cudaStream_t (torch:
    torch.cuda.current_stream().cuda_stream), 1 = legacy default stream,
    2 = per-thread default stream. None means 1. The producer is asked, via
    __dlpack__(stream=...), to order its work before that stream, and the
    copy to the host is ordered after the work queued on it so far.
    Ignored for CPU tensors.

CPU tensors are read before capture() returns; the tensor is released
right away. CUDA tensors are copied asynchronously on a side stream into
pinned memory and shipped from a CUDA callback: capture() returns at once,
the tensor is kept alive until its copy landed, but the engine must not
write into it before then (capture a fresh slice, not a buffer the next
step overwrites). flush() waits for the copies.

Results come later through poll(): one 'prediction' per request, or an
'error' (e.g. a duplicate id, code 6).

Raises:
  TypeError: not a DLPack tensor, or not float32/bfloat16/float16.
  ValueError: not 2-D, not dim columns, not one id per row, another device,
    non-positive strides, a bad stream or max_tokens, a consumed capsule.
  RuntimeError: a CUDA tensor without CUDA capture in this build or
    process, the pinned staging memory full (RESOURCE_EXHAUSTED: flush()
    and retry), or the client is closed.)doc")
      .def("request_priors", &PyClient::RequestPriors, py::arg("request_ids"),
           py::arg("product_line") = "", py::arg("prompt_tokens") = py::none(),
           py::arg("max_tokens") = 0,
           R"doc(Asks leapd for the length prior of requests that just arrived,
before their prefill (length-aware admission, docs/SCHEDULING.md).

Args:
  request_ids: the requests' ids.
  product_line: their product line ('' = default).
  prompt_tokens: prompt lengths in tokens (>= 1), an int for all or one
    per id. Required.
  max_tokens: each request's own output cap (0 = none).

Each available prior comes back through poll() as a 'prior' event
(predicted_tokens; Scheduler.apply() hands it to set_prior). A product line
that has not learned enough completions yet answers no event; a record
leapd refuses is an 'error' event (code 3). Fail-open: while no leapd
answers, or the connected one does not serve priors, the queries are
dropped at once (stats: priors_dropped) and the scheduler keeps first-come
placement. Never blocks.

Raises:
  ValueError / TypeError: bad prompt_tokens or max_tokens.)doc")
      .def("complete", &PyClient::Complete, py::arg("request_id"),
           py::arg("output_tokens"), py::arg("reason") = "stop",
           py::arg("prompt_tokens") = 0,
           R"doc(Reports how a request ended, so leapd learns from it.

Args:
  request_id: a captured request.
  output_tokens: tokens the request generated.
  reason: "stop" (EOS or stop string: learned), "length" (hit max_tokens:
    learned only when it reached leapd's budget), "cancelled" or "aborted"
    (not learned).
  prompt_tokens: the request's prompt length in tokens (0 = not given).
    Given, a 'stop' or 'length' completion also teaches leapd's length
    prior of the request's product line (request_priors).

The request stays known to the client until leapd acknowledges it (resent
after a reconnect). A completion leapd refuses UNAVAILABLE (a fleet member
without NATS, leapd recovering) is resent by the client after a backoff
(min_backoff_s doubling to max_backoff_s), with no event
(stats["completion_retries"]); any other refusal is an 'error' event and the
request is dropped. Unknown or already completed ids are ignored.

Raises:
  ValueError: negative output_tokens or prompt_tokens, or an unknown
    reason.)doc")
      .def(
          "cancel", &PyClient::Cancel, py::arg("request_id"),
          R"doc(Drops a request without learning from it. Unknown ids are ignored.)doc")
      .def("poll", &PyClient::Poll, py::arg("max") = py::none(),
           py::arg("timeout_s") = 0.0,
           R"doc(Takes the events that arrived, oldest first.

Args:
  max: at most this many (None = all).
  timeout_s: 0 (default) never waits: the call for an engine's step loop.
    Otherwise waits up to timeout_s seconds for at least one event (the GIL
    is released while waiting).

Returns:
  list[Event], possibly empty.)doc")
      .def("wait_connected", &PyClient::WaitConnected, py::arg("timeout_s"),
           R"doc(Waits up to timeout_s seconds until the client is connected to
leapd (startup checks and tests; the GIL is released while waiting).

Returns:
  True when connected, False at the deadline.)doc")
      .def(
          "flush", &PyClient::Flush,
          R"doc(Waits until every CUDA capture issued so far has been copied and
handed to the client, and releases those tensors (no-op without CUDA
captures). The GIL is released while waiting.

Raises:
  RuntimeError: a CUDA copy or conversion failed.)doc")
      .def(
          "close", &PyClient::Close,
          R"doc(Drains the CUDA captures, stops the background threads and closes
the connection. Idempotent; later calls other than close() raise
RuntimeError. Queued, unsent work is dropped.)doc")
      .def_property_readonly(
          "stats", &PyClient::Stats,
          R"doc(Counters since start, as a dict: connected, connects, resubmitted
(features resent after a sidecar restart), predictions, rescores, errors,
live (requests kept for resubmission), stalls (connections abandoned because
a message waited response_timeout_s for its answer), completion_retries
(completions leapd refused UNAVAILABLE, kept and resent after a backoff, no
event), priors (prior events received),
priors_unavailable (answered without a prior: the product line has not
learned enough), priors_dropped (not asked: no leapd answering, or one
without priors), priors_unsupported (the connected leapd does not serve
priors), degraded, degraded_reason,
cuda_captures_in_flight.)doc")
      .def_property_readonly("connected", &PyClient::connected,
                             "True while a session with leapd is up.")
      .def_property_readonly(
          "degraded", &PyClient::degraded,
          "True while no leapd answers (absent, hung, restarting): requests "
          "get no prediction and the scheduler keeps their arrival order; "
          "predictions resume by themselves. Never blocks.")
      .def_property_readonly("closed", &PyClient::closed, "True after close().")
      .def_property_readonly("dim", &PyClient::dim, "Feature width d.")
      .def_property_readonly("dtype", &PyClient::dtype,
                             "Element type shipped to leapd.")
      .def_property_readonly("endpoint", &PyClient::endpoint,
                             "leapd's address.")
      .def_property_readonly(
          "instance_id", &PyClient::instance_id,
          "The instance id sent in every Hello: the one given, or the random "
          "one made at start.")
      .def_property_readonly("response_timeout_s", &PyClient::response_timeout_s,
                             "Seconds without an answer before a connection "
                             "is abandoned as hung.")
      .def_property_readonly("shm_slots", &PyClient::shm_slots,
                             "Feature slots asked of an shm:// leapd.")
      .def_property_readonly("shm_ring_bytes", &PyClient::shm_ring_bytes,
                             "Bytes of each shm:// message ring.")
      .def(
          "__enter__", [](py::object self) { return self; },
          "Returns the client.")
      .def(
          "__exit__",
          [](PyClient& c, py::handle, py::handle, py::handle) {
            c.Close();
            return false;
          },
          "Closes the client.");

  py::class_<PyScheduler>(
      m, "Scheduler",
      R"doc(Countdown scheduler: which live requests get this decode step's slots.

Each step takes the `slots` live requests with the smallest
remaining = max(predicted_tokens - generated, remaining_floor), ties by
arrival; requests that waited `waiting_cap` steps without a slot go first;
optional exponential aging (priority = remaining * exp(-aging_rate *
steps_waited)). Requests without a prediction yet are placed by
`unpredicted`. Deterministic, no I/O.

Not thread-safe: call it from the engine's step loop only.)doc")
      .def(py::init([](int slots, int waiting_cap, double aging_rate,
                       double remaining_floor, const std::string& unpredicted,
                       double unpredicted_tokens, const std::string& policy,
                       double max_slowdown, double linear_aging,
                       int tail_window, double tail_quantile,
                       double bounded_linear_aging, int calibration_window,
                       const std::string& calibration,
                       double latency_target_s, double tail_budget,
                       int tail_budget_window, double target_quantile,
                       double give_up_reserve) {
             leap::shim::SchedulerOptions o;
             o.latency_target_s = latency_target_s;
             o.target_quantile = target_quantile;
             o.give_up_reserve = give_up_reserve;
             o.tail_budget = tail_budget;
             o.tail_budget_window = tail_budget_window;
             o.bounded_linear_aging = bounded_linear_aging;
             o.calibration_window = calibration_window;
             if (calibration == "additive") {
               o.calibration = leap::shim::BoundCalibration::kAdditive;
             } else if (calibration == "ratio") {
               o.calibration = leap::shim::BoundCalibration::kRatio;
             } else {
               throw py::value_error(
                   "calibration must be 'additive' or 'ratio', got '" +
                   calibration + "'");
             }
             o.policy = ParseSchedulingPolicy(policy);
             o.max_slowdown = max_slowdown;
             o.tail_window = tail_window;
             o.tail_quantile = tail_quantile;
             o.linear_aging = linear_aging;
             o.slots = slots;
             o.waiting_cap = waiting_cap;
             o.aging_rate = aging_rate;
             o.remaining_floor = remaining_floor;
             o.unpredicted = ParsePolicy(unpredicted);
             o.unpredicted_tokens = unpredicted_tokens;
             auto s = leap::shim::CountdownScheduler::Create(o);
             if (!s.ok())
               throw py::value_error(std::string(s.status().message()));
             return std::make_unique<PyScheduler>(*std::move(s));
           }),
           py::arg("slots") = 64, py::arg("waiting_cap") = 128,
           py::arg("aging_rate") = 0.0, py::arg("remaining_floor") = 1.0,
           py::arg("unpredicted") = "median",
           py::arg("unpredicted_tokens") = 256.0,
           py::arg("policy") = "countdown", py::arg("max_slowdown") = 2.5,
           py::arg("linear_aging") = 1.0, py::arg("tail_window") = 1000,
           py::arg("tail_quantile") = 0.99,
           py::arg("bounded_linear_aging") = 0.0,
           py::arg("calibration_window") = 1000,
           py::arg("calibration") = "additive",
           py::arg("latency_target_s") = 0.0, py::arg("tail_budget") = 0.005,
           py::arg("tail_budget_window") = 10000,
           py::arg("target_quantile") = 0.99,
           py::arg("give_up_reserve") = 0.5,
           R"doc(Args:
  slots: decode slots per step taken by select() (>= 1).
  waiting_cap: steps without a slot after which a request is promoted
    ahead of all others (0 disables).
  aging_rate: exponential aging rate (0 disables).
  remaining_floor: lower bound of remaining.
  unpredicted: where requests without a prediction go: "median" (as if
    their remaining were the median of the predicted ones; FCFS when the
    sidecar is down), "fixed" (as if it were unpredicted_tokens), "first"
    or "last".
  unpredicted_tokens: remaining assumed by "fixed", and by "median" while
    nothing is predicted.
  policy: "countdown" (the default), "bounded" (the countdown with the tail
    bound: a request whose remaining work no longer fits before its
    deadline, max_slowdown times the latency a virtual FCFS system with the
    same slots would give it, goes first, earliest deadline first), "hrrn"
    or "linear-aging" (baselines); see docs/SCHEDULING.md.
  max_slowdown: S of "bounded" (>= 1).
  tail_window, tail_quantile: "bounded"'s tail reference, the
    tail_quantile of the virtual FCFS latencies of the last tail_window
    requests (0 = off); a request may take S x max(its own, that).
  linear_aging: tokens of priority per step waited of "linear-aging".
  bounded_linear_aging: "bounded" ranks the requests whose deadline is not
    at risk by remaining - A x steps waited instead of the countdown (0 =
    the countdown); the deadline rule is unchanged.
  calibration_window: "bounded" adds to the estimates it places deadlines
    with the mean error (actual - estimate) of the last N completions given
    to observe_completion(), so they are unbiased for the mean (0 = off).
  calibration: the form of that correction: "additive" (the mean error,
    one number for all) or "ratio" (sum actual / sum estimate per group of
    octaves of the estimate, for errors that grow with the length).
  latency_target_s: "bounded" with a latency target in seconds of the
    engine's clock (set_time() before every step): every request's
    deadline is its arrival plus this, and the urgent ones are served in
    arrival order; 0 = the slowdown bound above.
  tail_budget, tail_budget_window: with a latency target, at most
    floor(tail_budget x tail_budget_window) deadlines are given up per
    tail_budget_window requests added (one carried in given up counts),
    each by a request turning urgent for the first time with at least
    the mean completed length left; needs completions reported to
    observe_completion() (tail_budget 0 = none against the budget;
    give_up_reserve may still give some up against credits).
  target_quantile: with a latency target, the share q of requests kept
    within it: each latency reported to observe_latency() earns 1 - q
    credits (at most (1 - q) x tail_budget_window banked) and one beyond
    the target costs 1; in debt the urgency test reads the deadline as
    arrival + s x latency_target_s, s = max(0.5, exp(0.02 x credits)),
    so that under a steady overload a share q finishes within the target
    (0 = s stays 1).
  give_up_reserve: with a latency target and target_quantile > 0, past
    tail_budget a request that would give up its deadline still does
    against one of the controller's credits while the credits minus those
    set aside (one per live request that gave up this way, its own
    included) stay >= give_up_reserve x the bank; the credit is set aside
    until remove(), and one carried to the next stage holds one of that
    stage's credits there; no more give up this way while (1 -
    give_up_reserve) x the bank are set aside (1 = none beyond
    tail_budget).

Raises:
  ValueError: an option out of range.)doc")
      .def("add", &PyScheduler::Add, py::arg("request_id"),
           py::arg("carried") = py::none(),
           R"doc(Makes a request live (no prediction yet, 0 generated). Add it
before capturing it, so its prediction finds it.

Args:
  carried: None, or the dict carry() of an earlier stage's "bounded"
    scheduler returned for it (age, virtual_left, virtual_estimate,
    tail_reference, and optionally was_urgent, gave_up and holds_credit):
    the request
    keeps the deadline it got at arrival there (one deadline from arrival
    across admission and decode; both schedulers must count the same
    steps, or with a latency target read the same clock, set_time()).
    Ignored by other policies.

Raises:
  ValueError: the id is live already, or a carried field is missing,
    negative (age, estimate, reference) or not finite, or holds_credit is
    set without gave_up.
  TypeError: carried is not a dict.)doc")
      .def("carry", &PyScheduler::Carry, py::arg("request_id"),
           R"doc(The deadline state of a live request of a "bounded" scheduler,
for add(id, carried=...) on the next stage's scheduler: dict with age
(steps since its first step here, or in the stage before), virtual_left
(its virtual FCFS finish minus the coming step), virtual_estimate,
tail_reference, was_urgent, gave_up and holds_credit (gave it up against
one of this stage's credits; the next stage then sets one of its own aside
until its remove()) (with a latency target only age and the three flags
matter, age in seconds).

Raises:
  KeyError: unknown id.
  RuntimeError: it has no deadline yet (not "bounded", or before its first
    step).)doc")
      .def("set_time", &PyScheduler::SetTime, py::arg("now_s"),
           py::arg("step_s"),
           R"doc(The engine's clock before the coming step (seconds, monotonic)
and its current decode step duration (seconds), for a "bounded" scheduler
with latency_target_s > 0; call it before every select() or order(), and
before add() at a request's arrival (its deadline counts from the clock
then). Until the first call the clock reads 0 and nobody turns urgent. Kept
and unused otherwise.

Raises:
  ValueError: a value not finite, step_s < 0, or now_s below the previous
    now_s.)doc")
      .def("observe_completion", &PyScheduler::ObserveCompletion,
           py::arg("estimate_tokens"), py::arg("actual_tokens"),
           R"doc(Reports a finished request's estimate (the prediction or prior
this scheduler placed it with) and its true output length: "bounded"
corrects its estimates by the mean error of the last calibration_window
reports. Report natural completions only. Ignored by other policies.

Raises:
  ValueError: a negative or non-finite value.)doc")
      .def("observe_latency", &PyScheduler::ObserveLatency,
           py::arg("latency_s"),
           R"doc(Reports a finished request's latency from arrival (seconds of
set_time()'s clock) to a "bounded" scheduler with a latency target, for its
controller (target_quantile). Report natural completions only, once each.
Ignored otherwise.

Raises:
  ValueError: a negative or non-finite value.)doc")
      .def_property_readonly(
          "target_scale", &PyScheduler::TargetScale,
          "The controller's factor s on latency_target_s in the urgency "
          "test (1 while its credits are not negative).")
      .def_property_readonly(
          "target_credits", &PyScheduler::TargetCredits,
          "The controller's credits: 1 - target_quantile earned per "
          "observe_latency() (at most (1 - q) x tail_budget_window banked), "
          "1 spent per latency beyond the target; in debt s = "
          "max(0.5, exp(0.02 x credits)).")
      .def_property_readonly(
          "credits_set_aside", &PyScheduler::CreditsSetAside,
          "give_up_reserve: the credits set aside by live requests that "
          "gave their deadline up against one.")
      .def_property_readonly(
          "service_correction", &PyScheduler::ServiceCorrection,
          "The bound's current additive correction in tokens (0 before any "
          "report, and with calibration=\"ratio\").")
      .def("service_ratio", &PyScheduler::ServiceRatio,
           py::arg("estimate_tokens"),
           "With calibration=\"ratio\": the factor the bound applies to an "
           "estimate of that many tokens (1 before any report, and with "
           "\"additive\").")
      .def("order", &PyScheduler::Order, py::arg("k"),
           R"doc(The first k live requests of the coming step, in select()'s
order, without committing anything (engines where every admitted request
decodes each step; a waiting queue).)doc")
      .def("commit", &PyScheduler::Commit, py::arg("ran"),
           R"doc(Commits one step in which the requests `ran` held a slot (every
other live request waited); select() is order() + commit().

Raises:
  KeyError: an id is not live (nothing committed). ValueError: a repeat.)doc")
      .def("commit_idle", &PyScheduler::CommitIdle, py::arg("steps"),
           R"doc(Commits `steps` empty steps at once while no request is live (an
idle engine's gap on the deadlines' clock): the same as `steps` calls of
commit([]), in O(1).

Raises:
  RuntimeError: a request is live. ValueError: steps < 0.)doc")
      .def("set_prediction", &PyScheduler::SetPrediction, py::arg("request_id"),
           py::arg("predicted_tokens"),
           R"doc(Sets a request's first prediction (tokens).

Raises:
  KeyError: unknown id. ValueError: negative or non-finite value.
  RuntimeError: it has a prediction already (use rescore).)doc")
      .def(
          "rescore", &PyScheduler::Rescore, py::arg("request_id"),
          py::arg("predicted_tokens"),
          R"doc(Replaces a request's prediction; its generated tokens are kept, so
the countdown continues from the new value. Also takes a first prediction.

Raises:
  KeyError: unknown id. ValueError: negative or non-finite value.)doc")
      .def("set_prior", &PyScheduler::SetPrior, py::arg("request_id"),
           py::arg("prior_tokens"),
           R"doc(Gives a request a length known before prefill (length-aware
admission): until its first prediction it is ranked as if predicted with
that value; ignored once it is predicted.

Raises:
  KeyError: unknown id. ValueError: negative or non-finite value.)doc")
      .def("remove", &PyScheduler::Remove, py::arg("request_id"),
           R"doc(Forgets a finished or cancelled request.

Raises:
  KeyError: unknown id.)doc")
      .def("select", &PyScheduler::Select, py::arg("slots") = py::none(),
           R"doc(Decides and commits one decode step.

Args:
  slots: slots this step (None = the scheduler's slots).

Returns:
  list[str]: up to `slots` live request ids, in priority order. They count
  one generated token each; every other live request waited one step.)doc")
      .def("apply", &PyScheduler::Apply, py::arg("events"),
           R"doc(Feeds a client's events into the scheduler: 'prediction' and
'rescore' events set the request's predicted_tokens, unless an event of a
newer readout version was applied to it already; 'prior' events call
set_prior (ignored once the request is predicted); events of requests that
are not live here and all other kinds are skipped.

  events = client.poll(); sched.apply(events); batch = sched.select()

Returns:
  int: how many events changed a prediction or set a prior.

Raises:
  TypeError: an element is not a leap_shim.Event.)doc")
      .def("request", &PyScheduler::Request, py::arg("request_id"),
           R"doc(A snapshot of a live request: dict with predicted_tokens (None
until predicted), generated, steps_waited, arrival, predictions,
prior_tokens (None without a prior), added_step, waited_total, deadline
(None before its first step and under other policies than "bounded"; with a
latency target deadline_origin + latency_target_s, while the urgency test
reads deadline_origin + target_scale x latency_target_s), deadline_origin,
was_urgent, gave_up and holds_credit (gave it up against a credit set aside
until remove(): give_up_reserve).

Raises:
  KeyError: unknown id.)doc")
      .def_property_readonly("size", &PyScheduler::size,
                             "Number of live requests.")
      .def_property_readonly(
          "counters", &PyScheduler::Counters,
          R"doc(Counters since creation, as a dict: steps, selections,
cap_promotions, aging_promotions, max_steps_waited, urgent_selections,
deadlines_given_up (of which credit_give_ups against give_up_reserve's
credits), latencies_observed, latencies_beyond_target, added, removed.)doc")
      .def("__len__", &PyScheduler::size, "Number of live requests.")
      .def("__contains__", &PyScheduler::Contains, py::arg("request_id"),
           "True when the request is live.");
}
