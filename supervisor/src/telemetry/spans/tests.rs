use opentelemetry::trace::{SpanId, Status, TraceId};
use opentelemetry::Value;
use opentelemetry_sdk::trace::SpanData;

use super::*;

fn spans() -> Spans {
    Spans::unexported(crate::telemetry::otlp::resource("sb-1", Some("gw")), "sb-1")
}

/// Ends everything still open (as the shutdown does) and returns what reached the queue.
fn finish(mut spans: Spans) -> Vec<SpanData> {
    let inner = spans.0.as_mut().unwrap();
    inner.end_open();
    inner.queue.snapshot()
}

fn attr(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.clone())
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

#[test]
fn one_trace_with_every_operation_under_the_root() {
    let mut s = spans();
    s.admission(SystemTime::now(), true);
    s.boot_ended(true);
    s.exec_dispatched(ProcId(1));
    s.exec_dispatched(ProcId(2));
    s.exec_dispatched(ProcId(3));
    s.exec_answered(ProcId(1), ExecOutcome::Started(42));
    s.exec_answered(ProcId(2), ExecOutcome::SpawnFailed);
    s.policy_update_received();
    s.policy_updated(3, UpdateOutcome::Applied);
    s.policy_updated(2, UpdateOutcome::Stale);
    s.stop_decided();
    s.vmm_exited(&StopReason::Terminated);
    let all = finish(s);
    assert_eq!(all.len(), 9, "{:#?}", all.iter().map(|s| &s.name).collect::<Vec<_>>());
    let root = named(&all, "sandbox")[0];
    assert_eq!(root.parent_span_id, SpanId::INVALID);
    for span in &all {
        assert_ne!(span.span_context.trace_id(), TraceId::INVALID);
        assert_ne!(span.span_context.span_id(), SpanId::INVALID);
        assert_eq!(span.span_context.trace_id(), root.span_context.trace_id());
        assert!(span.end_time >= span.start_time, "{}", span.name);
        assert_eq!(attr(span, "openshell.sandbox.id"), Some(Value::from("sb-1")));
        assert!(attr(span, "openshell.operation").is_some());
        if span.name != "sandbox" {
            assert_eq!(span.parent_span_id, root.span_context.span_id(), "{}", span.name);
            assert!(attr(span, "openshell.outcome").is_some(), "{}", span.name);
        }
    }
    let outcome = |span: &SpanData| attr(span, "openshell.outcome").map(|v| v.as_str().into_owned());
    assert_eq!(outcome(named(&all, "sandbox.boot")[0]).as_deref(), Some("ready"));
    assert_eq!(outcome(named(&all, "sandbox.admission")[0]).as_deref(), Some("approved"));
    let mut execs: Vec<_> = named(&all, "sandbox.exec")
        .into_iter()
        .map(|s| (attr(s, "openshell.process.id"), outcome(s), attr(s, "process.pid")))
        .collect();
    execs.sort_by_key(|e| format!("{:?}", e.0));
    assert_eq!(
        execs,
        vec![
            (Some(Value::I64(1)), Some("started".into()), Some(Value::I64(42))),
            (Some(Value::I64(2)), Some("spawn_failed".into()), None),
            (Some(Value::I64(3)), Some("unanswered".into()), None),
        ]
    );
    let updates = named(&all, "sandbox.policy_update");
    assert_eq!(updates.len(), 2);
    assert_eq!(attr(updates[0], "openshell.policy.revision"), Some(Value::I64(3)));
    assert_eq!(outcome(updates[0]).as_deref(), Some("applied"));
    assert_eq!(outcome(updates[1]).as_deref(), Some("stale"));
    assert!(matches!(updates[1].status, Status::Error { .. }));
    let stop = named(&all, "sandbox.stop")[0];
    assert_eq!(attr(stop, "openshell.stop.reason"), Some(Value::from("terminated")));
}

#[test]
fn a_failed_start_still_ends_its_spans() {
    let mut s = spans();
    s.admission(SystemTime::now(), false);
    let all = finish(s);
    let admission = named(&all, "sandbox.admission")[0];
    assert_eq!(attr(admission, "openshell.outcome"), Some(Value::from("refused")));
    assert!(matches!(admission.status, Status::Error { .. }));
    let boot = named(&all, "sandbox.boot")[0];
    assert_eq!(attr(boot, "openshell.outcome"), Some(Value::from("failed")));
}

#[test]
fn a_vmm_that_exits_on_its_own_gets_a_stop_span() {
    let mut s = spans();
    s.boot_ended(true);
    s.vmm_exited(&StopReason::VmmExited(None));
    let all = finish(s);
    let stop = named(&all, "sandbox.stop");
    assert_eq!(stop.len(), 1);
    assert_eq!(attr(stop[0], "openshell.stop.reason"), Some(Value::from("vmm_exited")));
}

#[test]
fn open_exec_spans_are_bounded() {
    let mut s = spans();
    let n = u32::try_from(MAX_OPEN_EXEC_SPANS).unwrap() + 10;
    for id in 1..=n {
        s.exec_dispatched(ProcId(id));
    }
    assert_eq!(s.0.as_ref().unwrap().execs.len(), MAX_OPEN_EXEC_SPANS);
    // An answer for a process without a span is ignored.
    s.exec_answered(ProcId(n), ExecOutcome::Refused);
    assert_eq!(named(&finish(s), "sandbox.exec").len(), MAX_OPEN_EXEC_SPANS);
}

#[test]
fn without_an_endpoint_everything_is_a_no_op() {
    let mut s = Spans::default();
    s.boot_ended(true);
    s.exec_dispatched(ProcId(1));
    s.vmm_exited(&StopReason::Terminated);
    assert!(s.0.is_none());
}

#[test]
fn guest_answers_are_recognized() {
    let started = ToHost::Process(ProcessEvent::Started { id: ProcId(4), pid: 9, stdin_window: 1, output_window: 1 });
    assert_eq!(spawn_answer(&started), Some((ProcId(4), ExecOutcome::Started(9))));
    assert_eq!(spawn_answer(&ToHost::Pong { nonce: 1 }), None);
    assert_eq!(dispatched_spawn(&ToGuest::Ping { nonce: 1 }), None);
}
