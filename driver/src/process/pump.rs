//! The one loop of a process session: it moves messages between a [`SandboxEnd`] and a [`ClientEnd`] and
//! leaves every decision to the [`ProcessSession`].

use std::collections::VecDeque;

use tokio::time::Instant;

use super::session::{Act, ProcessSession, Wait};
use super::{ClientEnd, FromClient, Outcome, SandboxEnd};

/// Runs `session` to its end.
pub async fn run(mut session: ProcessSession, sandbox: &mut impl SandboxEnd, client: &mut impl ClientEnd) -> Outcome {
    // The deadline of a bounded wait, set when that wait begins.
    let mut bounded: Option<(Wait, Instant)> = None;
    loop {
        let wait = session.wait();
        let acts = match wait {
            Wait::Done => break,
            Wait::Both => tokio::select! {
                msg = sandbox.recv() => session.from_sandbox(msg),
                msg = client.next(session.listening()) => session.from_client(msg),
            },
            Wait::Delivery => session.from_client(client.next(session.listening()).await),
            Wait::Refusal(within) | Wait::Verdict(within) => {
                let deadline = match bounded {
                    Some((w, at)) if w == wait => at,
                    _ => Instant::now() + within,
                };
                bounded = Some((wait, deadline));
                let refusal = matches!(wait, Wait::Refusal(_));
                tokio::select! {
                    msg = sandbox.recv(), if refusal => session.from_sandbox(msg),
                    msg = client.next(session.listening()) => session.from_client(msg),
                    () = tokio::time::sleep_until(deadline) => session.timed_out(),
                }
            }
        };
        perform(&mut session, sandbox, client, acts).await;
    }
    sandbox.close().await;
    session.outcome().cloned().unwrap_or(Outcome { ended: super::Ended::Lost, status: None, failure: None })
}

/// Sends what the session decided, in order; what the sending itself tells (output the client took at once,
/// an end that is gone) goes back to the session.
async fn perform(
    session: &mut ProcessSession,
    sandbox: &mut impl SandboxEnd,
    client: &mut impl ClientEnd,
    acts: Vec<Act>,
) {
    let mut acts = VecDeque::from(acts);
    while let Some(act) = acts.pop_front() {
        let more = match act {
            Act::Sandbox(msg) => match sandbox.send(msg).await {
                Ok(()) => Vec::new(),
                Err(lost) => session.from_sandbox(Err(lost)),
            },
            Act::Client(msg) => match client.deliver(msg).await {
                Ok(0) => Vec::new(),
                Ok(taken) => session.from_client(FromClient::Delivered(taken)),
                Err(_) => session.from_client(FromClient::Gone),
            },
        };
        acts.extend(more);
    }
}
