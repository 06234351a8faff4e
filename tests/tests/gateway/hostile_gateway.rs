//! A gateway, or a client behind it, that does not play by the rules: channels and relays without end, a
//! token that stopped being valid, a relay whose reader stalls. Each is bounded, refused with a reason and
//! recorded; the sandbox beside it runs on.

use std::time::{Duration, Instant};

use vm_test_support::events;
use vm_test_support::openshell::ssh;
use vm_test_support::procs::PeakRss;
use vm_test_support::{wait_until, Scratch};

use crate::common::Gw;

const IDLE: [&str; 3] = ["/bin/sh", "-c", "echo main-started; exec sleep 100000"];
/// Channels one relayed SSH connection may hold open (the supervisor's `gateway::ssh::MAX_CHANNELS`).
const MAX_CHANNELS: usize = 16;
/// Relays open at once into one sandbox (`gateway::relay::MAX_RELAYS`).
const MAX_RELAYS: usize = 32;
/// The supervisor's peak memory while a relay's reader stalls on 64 MiB of output.
const STALLED_PEAK_RSS_MIB: u64 = 64;

#[test]
fn channels_and_relays_without_end_are_bounded_refused_and_recorded_and_the_neighbour_runs_on() {
    let s = Scratch::with_deadline("gw-flood", Duration::from_secs(480));
    let mut gw = Gw::start(&s);
    let (target, _) = gw.ready("target", &IDLE, false);
    let (neighbour, _) = gw.ready("neighbour", &IDLE, false);
    let (opened, refused_channel, relays_opened, refused_relay, neighbour_ran) = gw.gateway.rt.block_on(async {
        // One SSH connection that opens session channels and never uses them.
        let handle = ssh(gw.gateway.relay(&target, None).await.unwrap()).await.unwrap();
        let mut channels = Vec::new();
        let mut refused_channel = false;
        for _ in 0..MAX_CHANNELS + 4 {
            match handle.channel_open_session().await {
                Ok(channel) => channels.push(channel),
                Err(_) => {
                    refused_channel = true;
                    break;
                }
            }
        }
        // Relays opened and held, one more than the bound.
        let mut relays = Vec::new();
        let mut refused_relay = String::new();
        for _ in 0..MAX_RELAYS + 4 {
            match gw.gateway.relay(&target, None).await {
                Ok(relay) => relays.push(relay),
                Err(why) => {
                    refused_relay = why;
                    break;
                }
            }
        }
        let neighbour_ran = vm_test_support::openshell::exec(&gw.gateway, &neighbour, &["echo", "fine"], b"", false)
            .await
            .map(|o| o.stdout_text() == "fine\n")
            .unwrap_or(false);
        (channels.len(), refused_channel, relays.len(), refused_relay, neighbour_ran)
    });
    eprintln!("e2e: {opened} channels then a refusal; {relays_opened} relays then {refused_relay:?}");
    assert_eq!(opened, MAX_CHANNELS, "a connection holds at most its bound of channels");
    assert!(refused_channel, "the next channel is refused");
    // The flood's first connection holds one relay of the bound.
    assert_eq!(relays_opened, MAX_RELAYS - 1, "relays up to the bound");
    assert!(refused_relay.contains("too many relays"), "{refused_relay}");
    assert!(neighbour_ran, "the neighbour answered during the flood");
    // Everything held was let go when the test's side dropped it: the sandbox serves again, once the supervisor
    // has seen the relays close (a relay refused meanwhile is tried again).
    let serves = || {
        let exec = vm_test_support::openshell::exec(&gw.gateway, &target, &["true"], b"", false);
        gw.gateway.rt.block_on(exec).is_ok_and(|o| o.code == Some(0))
    };
    assert!(wait_until(Duration::from_secs(30), serves), "the sandbox never served again");
    let found = events::finding_descs(&events::settled(&gw.serve.sandbox(&target)));
    assert!(found.iter().any(|f| f.contains("too many relays")), "recorded: {found:#?}");
}

#[test]
fn a_token_the_gateway_stops_accepting_ends_the_session_and_is_retried_only_with_backoff() {
    let s = Scratch::with_deadline("gw-revoked", Duration::from_secs(420));
    let mut gw = Gw::start(&s);
    let (revoked, _) = gw.ready("revoked", &IDLE, false);
    let (neighbour, _) = gw.ready("neighbour", &IDLE, false);
    gw.gateway.revoke(&revoked);
    gw.gateway.restart();
    let before = gw.gateway.seen().refused;
    let watched = Instant::now();
    gw.wait_connected(&neighbour);
    std::thread::sleep(Duration::from_secs(20).saturating_sub(watched.elapsed()));
    let attempts = gw.gateway.seen().refused - before;
    eprintln!("e2e: {attempts} refused attempts in 20 s from the supervisor whose token was revoked");
    assert!(!gw.gateway.connected(&revoked), "never let in again");
    // Backoff from 1 s, doubling: 1 + 2 + 4 + 8 covers 15 s, so at most 6 tries in 20 s, never a storm.
    assert!((1..=6).contains(&attempts), "{attempts} attempts");
    assert_eq!(gw.exec(&neighbour, &["echo", "fine"], b"", false).stdout_text(), "fine\n");
    let recorded = events::settled(&gw.serve.sandbox(&revoked));
    let refused_session = recorded
        .iter()
        .any(|e| e["class_uid"] == 6003 && e["api"]["operation"] == "ConnectSupervisor" && e["status_id"] == 2);
    assert!(refused_session, "the refused session is recorded");
}

#[test]
fn a_relay_whose_reader_stalls_holds_back_its_own_output_only() {
    let s = Scratch::with_deadline("gw-stall", Duration::from_secs(420));
    let mut gw = Gw::start(&s);
    let (stalled, _) = gw.ready("stalled", &IDLE, false);
    let (neighbour, _) = gw.ready("neighbour", &IDLE, false);
    let peak = PeakRss::supervisors(&s.dir, &stalled);
    let neighbour_ran = gw.gateway.rt.block_on(async {
        let handle = ssh(gw.gateway.relay(&stalled, None).await.unwrap()).await.unwrap();
        let channel = handle.channel_open_session().await.unwrap();
        channel.exec(true, "head -c 67108864 /dev/zero").await.unwrap();
        // Never read: let the flow control stop it, then see the neighbour unaffected.
        tokio::time::sleep(Duration::from_secs(15)).await;
        let ran = vm_test_support::openshell::exec(&gw.gateway, &neighbour, &["echo", "fine"], b"", false)
            .await
            .map(|o| o.stdout_text() == "fine\n")
            .unwrap_or(false);
        drop(channel);
        ran
    });
    let peak_mib = peak.peak() >> 10;
    eprintln!("e2e: a stalled relay's supervisor peaked at {peak_mib} MiB");
    assert!(neighbour_ran);
    assert!(peak_mib < STALLED_PEAK_RSS_MIB, "{peak_mib} MiB");
}
