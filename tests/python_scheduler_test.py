#!/usr/bin/python3
"""The Python binding of the tail bound (leap_shim.Scheduler, policy
"bounded"), against brute-force references written here:

  - one deadline from arrival: a waiting queue and a decode stage, both
    "bounded" schedulers counting the same steps; every request's deadline
    in the queue equals a virtual FCFS system computed here (servers, prior
    plus the learned correction, S x latency), and carry() / add(carried=)
    hands the same deadline to the decode stage;
  - observe_completion(): the correction is the mean error of the window,
    and a new request's virtual job carries it;
  - calibration="ratio": service_ratio(x) equals a reference that groups
    the window's completions by octave of the estimate (sum actual / sum
    estimate per group), and a new request's deadline is S x x' x ratio;
  - bounded_linear_aging: requests whose deadline is not at risk are ranked
    by remaining - A x steps waited, step by step as a brute force ranks
    them;
  - commit_idle() moves the step count of an empty scheduler;
  - bad input raises the documented exception and changes nothing.

No leapd, no torch: the scheduler alone (deterministic, no I/O).

Run: /usr/bin/python3 tests/python_scheduler_test.py --module-dir DIR
"""

import math
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "support"))
import test_main  # noqa: E402  (tests/support/test_main.py)

ARGS = None
leap_shim = None


def setUpModule():
    global leap_shim
    leap_shim = test_main.import_leap_shim(ARGS.module_dir)


class VirtualFcfs:
    """The bound's virtual FCFS system: `servers` servers, jobs in arrival
    order, each on the server that frees first (docs/SCHEDULING.md)."""

    def __init__(self, servers):
        self.servers = servers
        self.free = []

    def place(self, now, job):
        start = now
        if len(self.free) == self.servers:
            self.free.sort()
            start = max(now, self.free.pop(0))
        self.free.append(start + job)
        return start + job


class OneDeadlineFromArrivalTest(unittest.TestCase):

    def test_queue_deadlines_match_reference_and_carry_into_decode(self):
        rng = random.Random(7)
        slots, resident, s_max = 2, 4, 2.0
        kw = dict(slots=slots, waiting_cap=0, policy="bounded",
                  max_slowdown=s_max, tail_window=0, calibration_window=4)
        queue = leap_shim.Scheduler(**kw)
        decode = leap_shim.Scheduler(**kw)
        ref = VirtualFcfs(slots)
        errors = []  # the queue's reported (actual - estimate), window 4
        prior, true_len, want_deadline = {}, {}, {}
        arrived_at = {}
        generated = {}
        placed = set()
        next_id, finished = 0, 0
        for step in range(400):
            # Arrivals: bursts of 0..3 requests with a prior each.
            for _ in range(rng.choice([0, 0, 1, 3])):
                rid = "r%03d" % next_id
                next_id += 1
                true_len[rid] = rng.randint(1, 30)
                prior[rid] = float(rng.randint(1, 20))
                queue.add(rid)
                queue.set_prior(rid, prior[rid])
                arrived_at[rid] = step
            # Decode: every live request of the decode stage keeps the
            # deadline it got in the queue.
            ran = decode.select()
            for rid in ran:
                generated[rid] += 1
            for rid in list(generated):
                if rid in ran and generated[rid] >= true_len[rid]:
                    decode.remove(rid)
                    del generated[rid]
                    finished += 1
                    errors.append(true_len[rid] - prior[rid])
                    del errors[:-4]
                    queue.observe_completion(prior[rid], true_len[rid])
            # The reference places this step's new requests (the queue does
            # so at its order() below), in arrival
            # order, with the correction as it stands now.
            correction = sum(errors) / len(errors) if errors else 0.0
            self.assertEqual(queue.service_correction, correction)
            for rid in sorted(arrived_at, key=lambda r: int(r[1:])):
                if rid in placed:
                    continue
                placed.add(rid)
                job = max(1.0, prior[rid] + correction)
                finish = ref.place(float(step), job)
                want_deadline[rid] = arrived_at[rid] + s_max * max(
                    finish - arrived_at[rid], 1.0)
            # Admission: the queue's order, up to the free room.
            room = resident - len(decode)
            admitted = queue.order(room) if len(queue) else []
            queue.commit(admitted)
            for rid in admitted:
                self.assertEqual(queue.request(rid)["deadline"],
                                 want_deadline[rid], rid)
                carried = queue.carry(rid)
                self.assertEqual(carried["age"], step + 1 - arrived_at[rid])
                queue.remove(rid)
                decode.add(rid, carried=carried)
                got = decode.request(rid)
                # Both stages count the same steps: the same deadline and
                # origin, on the decode stage's clock.
                self.assertAlmostEqual(got["deadline"], want_deadline[rid],
                                       places=9, msg=rid)
                self.assertEqual(got["deadline_origin"], arrived_at[rid])
                generated[rid] = 0
            for rid in list(arrived_at):
                if rid in queue:
                    self.assertEqual(queue.request(rid)["deadline"],
                                     want_deadline[rid], rid)
        self.assertGreater(finished, 40)
        self.assertNotEqual(queue.service_correction, 0)
        self.assertEqual(queue.counters["steps"], decode.counters["steps"])
        self.assertGreater(queue.counters["steps"], 0)

    def test_observe_completion_corrects_new_jobs(self):
        s = leap_shim.Scheduler(slots=1, waiting_cap=0, policy="bounded",
                                max_slowdown=2.0, tail_window=0,
                                calibration_window=2)
        self.assertEqual(s.service_correction, 0.0)
        s.observe_completion(10.0, 40.0)   # +30
        s.observe_completion(20.0, 10.0)   # -10
        self.assertEqual(s.service_correction, 10.0)
        s.observe_completion(5.0, 35.0)    # +30, drops +30
        self.assertEqual(s.service_correction, 10.0)
        s.observe_completion(0.0, 50.0)    # +50, drops -10
        self.assertEqual(s.service_correction, 40.0)
        s.add("a")
        s.set_prediction("a", 12.0)
        self.assertEqual(s.order(1), ["a"])  # places its deadline
        self.assertEqual(s.request("a")["deadline"], 2.0 * (12.0 + 40.0))
        # Other policies ignore completions.
        c = leap_shim.Scheduler()
        c.observe_completion(1.0, 100.0)
        self.assertEqual(c.service_correction, 0.0)


def reference_ratios(samples, octaves=32, min_group=64):
    """The ratio calibration's factor per octave of x' = max(x, 1), from
    the (estimate, actual) pairs of the window, oldest first
    (docs/SCHEDULING.md, "The ratio correction"): octaves merged from the
    bottom up until a group holds min_group completions, a short top group
    joined to the one below, each group's ratio sum actual / sum x'. Sums
    in the module's order (per octave oldest first, then octave by octave
    bottom up), so the floats are the same."""
    def octave(x):
        return min(math.frexp(max(x, 1.0))[1] - 1, octaves - 1)
    a_sum, e_sum, count = [0.0] * octaves, [0.0] * octaves, [0] * octaves
    for est, act in samples:
        b = octave(est)
        a_sum[b] += act
        e_sum[b] += max(est, 1.0)
        count[b] += 1
    ratio = [1.0] * octaves
    groups = []  # [first, end, sum actual, sum estimate] of closed groups
    first, a, e, c = 0, 0.0, 0.0, 0
    for b in range(octaves):
        a += a_sum[b]
        e += e_sum[b]
        c += count[b]
        if c >= min_group:
            groups.append([first, b + 1, a, e])
            first, a, e, c = b + 1, 0.0, 0.0, 0
    if first < octaves:
        if groups:
            groups[-1] = [groups[-1][0], octaves, groups[-1][2] + a, groups[-1][3] + e]
        else:
            groups.append([first, octaves, a, e])
    for lo, hi, sa, se in groups:
        for b in range(lo, hi):
            ratio[b] = sa / se if se > 0 else 1.0
    return lambda x: ratio[octave(x)]


class RatioCalibrationTest(unittest.TestCase):

    def test_service_ratio_matches_reference_and_places_deadlines(self):
        rng = random.Random(5)
        window = 300
        s = leap_shim.Scheduler(slots=3, waiting_cap=0, policy="bounded",
                                max_slowdown=2.0, tail_window=0,
                                calibration_window=window, calibration="ratio")
        self.assertEqual(s.service_ratio(10.0), 1.0)  # no report yet
        samples = []
        for step in range(700):
            # Estimates over octaves 0..11 (and below 1), errors that grow
            # with the length and a bias that differs per range.
            est = rng.choice((0.5, 1.0)) if step % 50 == 0 else \
                math.exp(rng.uniform(0.0, 8.0))
            act = max(0.0, est * (0.6 + 0.3 * math.log1p(est)) * rng.lognormvariate(0, 0.4))
            s.observe_completion(est, act)
            samples.append((est, act))
            if step in (0, 40, 63, 64, 130, 299, 300, 451, 699):
                ratio = reference_ratios(samples[-window:])
                for x in (0.0, 0.5, 1.0, 1.5, 3.0, 7.9, 8.0, 100.0, 1000.0,
                          2500.0, 4096.0, 1e6, 1e12):
                    self.assertEqual(s.service_ratio(x), ratio(x),
                                     "step %d, x %g" % (step, x))
        ratio = reference_ratios(samples[-window:])
        self.assertGreater(len({ratio(2.0 ** b) for b in range(12)}), 1)
        self.assertEqual(s.service_correction, 0.0)  # no additive part
        # A new request's job is x' x ratio(x): with a virtual server free
        # for each (3 slots) and the tail reference off, its deadline is
        # S x job.
        for rid, x in (("a", 12.0), ("b", 700.0), ("c", 0.25)):
            s.add(rid)
            s.set_prediction(rid, x)
        self.assertEqual(len(s.order(3)), 3)
        for rid, x in (("a", 12.0), ("b", 700.0), ("c", 0.25)):
            want = 2.0 * max(1.0, max(x, 1.0) * ratio(x))
            self.assertAlmostEqual(s.request(rid)["deadline"], want,
                                   delta=1e-12 * want, msg=rid)
        # "additive" has no ratio; a bad form is a ValueError naming it.
        additive = leap_shim.Scheduler(policy="bounded", calibration="additive")
        additive.observe_completion(10.0, 40.0)
        self.assertEqual(additive.service_ratio(10.0), 1.0)
        self.assertEqual(additive.service_correction, 30.0)
        with self.assertRaises(ValueError) as cm:
            leap_shim.Scheduler(policy="bounded", calibration="multiplicative")
        self.assertEqual(str(cm.exception),
                         "calibration must be 'additive' or 'ratio', got "
                         "'multiplicative'")


class BoundedLinearAgingTest(unittest.TestCase):

    def test_ranked_tier_is_linear_aging(self):
        rng = random.Random(3)
        a = 0.5
        # S so large that no deadline comes due: the ranked tier decides.
        s = leap_shim.Scheduler(slots=2, waiting_cap=0, policy="bounded",
                                max_slowdown=1e6, bounded_linear_aging=a)
        pred, gen, waited, arrival = {}, {}, {}, {}
        next_id = 0
        plain_order_differs = False
        for step in range(120):
            if step % 3 == 0 and next_id < 30:
                for _ in range(2):
                    rid = "q%02d" % next_id
                    arrival[rid] = next_id
                    next_id += 1
                    pred[rid] = float(rng.randint(1, 80))
                    gen[rid], waited[rid] = 0, 0
                    s.add(rid)
                    s.set_prediction(rid, pred[rid])

            def remaining(r):
                return max(pred[r] - gen[r], 1.0)
            want = sorted(pred, key=lambda r: (
                remaining(r) - a * waited[r], arrival[r]))[:2]
            plain = sorted(pred, key=lambda r: (remaining(r), arrival[r]))[:2]
            plain_order_differs |= plain != want
            self.assertEqual(s.select(), want, "step %d" % step)
            for r in pred:
                if r in want:
                    gen[r] += 1
                else:
                    waited[r] += 1
                self.assertEqual(s.request(r)["waited_total"], waited[r])
            for r in want:
                if gen[r] >= pred[r]:
                    s.remove(r)
                    for d in (pred, gen, waited):
                        del d[r]
        self.assertTrue(plain_order_differs)
        self.assertEqual(s.counters["urgent_selections"], 0)


class LatencyTargetTest(unittest.TestCase):
    """latency_target_s: deadline = the clock at add() + the target, urgency
    in seconds with set_time()'s step duration; urgent requests in arrival
    order; the tail budget gives up a long request's deadline."""

    def test_deadlines_in_seconds_and_urgent_in_arrival_order(self):
        s = leap_shim.Scheduler(policy="bounded", slots=1, waiting_cap=0,
                                latency_target_s=10.0, tail_budget=0.0)
        s.set_time(100.0, 0.5)
        s.add("long")
        s.set_prediction("long", 40.0)
        s.set_time(101.0, 0.5)
        s.add("short")
        s.set_prediction("short", 2.0)
        # 40 tokens x 0.5 s no longer fit before 110 s: "long" goes first.
        self.assertEqual(s.select(), ["long"])
        self.assertEqual(s.request("long")["deadline"], 110.0)
        self.assertEqual(s.request("short")["deadline"], 111.0)
        s.set_time(103.5, 0.5)
        carried = s.carry("short")
        self.assertEqual(carried["age"], 2.5)
        d = leap_shim.Scheduler(policy="bounded", latency_target_s=10.0)
        d.set_time(7.0, 0.5)
        d.add("short", carried=carried)
        self.assertEqual(d.request("short")["deadline"], 14.5)
        with self.assertRaises(ValueError):
            s.set_time(50.0, 0.5)  # the clock went back
        with self.assertRaises(ValueError):
            s.set_time(200.0, -1.0)
        with self.assertRaises(ValueError):
            leap_shim.Scheduler(latency_target_s=-1.0)
        with self.assertRaises(ValueError):
            leap_shim.Scheduler(tail_budget=0.9)
        with self.assertRaises(ValueError):
            leap_shim.Scheduler(tail_budget_window=0)

    def test_controller_tightens_the_urgency_test(self):
        def two(q):
            s = leap_shim.Scheduler(policy="bounded", slots=1, waiting_cap=0,
                                    latency_target_s=10.0, tail_budget=0.0,
                                    target_quantile=q)
            for _ in range(200):
                s.observe_latency(20.0)  # every one beyond the target
            s.set_time(0.0, 1.0)
            s.add("long")
            s.set_prediction("long", 5.0)
            s.add("short")
            s.set_prediction("short", 1.0)
            return s
        off = two(0.0)
        self.assertEqual(off.target_scale, 1.0)
        self.assertEqual(off.select(), ["short"])
        on = two(0.9)
        # 200 misses net -0.9 credits each: the debt stops at
        # log(0.5) / 0.02, the scale at its floor; deadline read 5 s.
        self.assertAlmostEqual(on.target_credits, math.log(0.5) / 0.02,
                               places=9)
        self.assertAlmostEqual(on.target_scale, 0.5, places=12)
        self.assertEqual(on.counters["latencies_observed"], 200)
        self.assertEqual(on.counters["latencies_beyond_target"], 200)
        self.assertEqual(on.select(), ["long"])
        self.assertEqual(on.request("long")["deadline"], 10.0)
        self.assertTrue(on.request("long")["was_urgent"])
        self.assertFalse(on.request("short")["was_urgent"])
        on.observe_latency(1.0)  # within: +0.1 credit
        self.assertAlmostEqual(on.target_scale, 0.5 * math.exp(0.002),
                               places=12)
        with self.assertRaises(ValueError):
            on.observe_latency(-1.0)
        with self.assertRaises(ValueError):
            leap_shim.Scheduler(target_quantile=1.0)

    def test_tail_budget_gives_up_a_long_deadline(self):
        s = leap_shim.Scheduler(policy="bounded", slots=1, waiting_cap=0,
                                latency_target_s=10.0, tail_budget=0.5,
                                tail_budget_window=4, calibration_window=10)
        s.observe_completion(10.0, 10.0)  # mean completed length 10
        s.set_time(0.0, 1.0)
        for rid in ("a", "b"):
            s.add(rid)
            s.set_prediction(rid, 30.0)
        # floor(0.5 x 2) = 1 deadline may be given up: "a" (first in
        # arrival order) gives it up, "b" stays urgent and runs.
        self.assertEqual(s.select(), ["b"])
        self.assertTrue(s.request("a")["gave_up"])
        self.assertFalse(s.request("b")["gave_up"])
        self.assertEqual(s.counters["deadlines_given_up"], 1)
        self.assertTrue(s.carry("a")["gave_up"])

    def test_give_up_against_credits(self):
        def make(reserve):
            s = leap_shim.Scheduler(policy="bounded", slots=1, waiting_cap=0,
                                    latency_target_s=10.0, tail_budget=0.0,
                                    tail_budget_window=10,
                                    target_quantile=0.5,
                                    give_up_reserve=reserve,
                                    calibration_window=10)
            s.observe_completion(10.0, 10.0)  # mean completed length 10
            for _ in range(12):
                s.observe_latency(1.0)  # bank (1 - 0.5) x 10 = 5 credits
            s.set_time(0.0, 1.0)
            for rid in ("a", "b"):
                s.add(rid)
                s.set_prediction(rid, 30.0)
            return s
        # Reserve 0.7 x 5 = 3.5: "a" leaves 5 - 1 >= 3.5 and gives up,
        # "b" would leave 5 - 2 < 3.5 and stays urgent.
        s = make(0.7)
        self.assertEqual(s.select(), ["b"])
        self.assertTrue(s.request("a")["gave_up"])
        self.assertFalse(s.request("b")["gave_up"])
        self.assertEqual(s.counters["credit_give_ups"], 1)
        self.assertEqual(s.counters["deadlines_given_up"], 1)
        self.assertEqual(s.credits_set_aside, 1)
        self.assertEqual(s.target_credits, 5.0)
        self.assertTrue(s.request("a")["holds_credit"])
        self.assertFalse(s.request("b")["holds_credit"])
        carried = s.carry("a")
        self.assertTrue(carried["gave_up"] and carried["holds_credit"])
        s.remove("a")
        self.assertEqual(s.credits_set_aside, 0)
        # The next stage sets one of its own credits aside for it.
        nxt = leap_shim.Scheduler(policy="bounded", latency_target_s=10.0,
                                  target_quantile=0.5)
        nxt.set_time(0.0, 1.0)
        nxt.add("a", carried=carried)
        self.assertTrue(nxt.request("a")["holds_credit"])
        self.assertEqual(nxt.credits_set_aside, 1)
        with self.assertRaises(ValueError):
            nxt.add("x", carried=dict(carried, gave_up=False))
        # The whole bank in reserve: nobody gives up against credits.
        s = make(1.0)
        self.assertEqual(s.select(), ["a"])
        self.assertEqual(s.counters["credit_give_ups"], 0)
        with self.assertRaises(ValueError):
            leap_shim.Scheduler(give_up_reserve=1.5)


class BadInputTest(unittest.TestCase):

    def test_errors(self):
        with self.assertRaises(ValueError):
            leap_shim.Scheduler(calibration_window=-1)
        with self.assertRaises(ValueError):
            leap_shim.Scheduler(policy="bounded", bounded_linear_aging=-1.0)
        with self.assertRaises(ValueError):
            leap_shim.Scheduler(bounded_linear_aging=math.inf)
        s = leap_shim.Scheduler(policy="bounded")
        good = {"age": 3.0, "virtual_left": 5.0, "virtual_estimate": 4.0,
                "tail_reference": 0.0}
        for bad in ({"age": 1.0}, dict(good, age=-1.0),
                    dict(good, virtual_left=math.nan),
                    dict(good, extra=1.0)):
            with self.assertRaises(ValueError):
                s.add("a", carried=bad)
        with self.assertRaises(TypeError):
            s.add("a", carried=[1.0, 2.0, 3.0, 4.0])
        self.assertEqual(len(s), 0)
        with self.assertRaises(KeyError):
            s.carry("a")
        s.add("a", carried=good)
        # Its deadline is fixed at once: origin = coming step - age.
        self.assertEqual(s.request("a")["deadline_origin"], -3.0)
        self.assertEqual(s.request("a")["deadline"], -3.0 + 2.5 * 8.0)
        self.assertEqual(s.carry("a"),
                         dict(good, was_urgent=False, gave_up=False,
                              holds_credit=False))
        for bad_flag in (dict(good, gave_up=1.0), dict(good, was_urgent="x"),
                         dict(good, holds_credit=1)):
            with self.assertRaises(ValueError):
                s.add("c", carried=bad_flag)
        s.add("b")
        with self.assertRaises(RuntimeError):
            s.carry("b")  # no deadline before its first step
        for est, act in ((-1.0, 1.0), (1.0, math.nan), (math.inf, 2.0)):
            with self.assertRaises(ValueError):
                s.observe_completion(est, act)
        self.assertEqual(s.service_correction, 0.0)
        with self.assertRaises(KeyError):
            s.commit(["a", "zz"])
        with self.assertRaises(ValueError):
            s.commit(["a", "a"])
        self.assertEqual(s.counters["steps"], 0)
        c = leap_shim.Scheduler()
        c.add("x")
        c.select()
        with self.assertRaises(RuntimeError):
            c.carry("x")  # countdown: no deadlines
        with self.assertRaises(RuntimeError):
            c.commit_idle(5)  # a request is live
        c.remove("x")
        with self.assertRaises(ValueError):
            c.commit_idle(-1)
        c.commit_idle(5)
        self.assertEqual(c.counters["steps"], 6)


def main():
    global ARGS
    ARGS = test_main.parse_args(__doc__, "module-dir")
    test_main.run()


if __name__ == "__main__":
    main()
