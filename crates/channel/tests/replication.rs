//! The channel replica machine in a small in-process cluster on virtual time.

mod harness;

use harness::{node, Cluster, Faults, Outcome};
use std::time::Duration;
use tidings_channel::machine::{AppendError, MachineConfig, RoleKind};
use tidings_store::message::MessageLog;
use tidings_types::{Seq, WriteFence};

fn quiet() -> Faults {
    Faults { loss: 0, duplicate: 0, delay_ms: (1, 3), disk_ms: (1, 2) }
}

fn config() -> MachineConfig {
    MachineConfig {
        isr_lag: Duration::from_secs(3),
        isr_alive: Duration::from_secs(2),
        append_timeout: Duration::from_secs(5),
        pull_park: Duration::from_millis(200),
        pull_timeout: Duration::from_millis(600),
        idle_pull_interval: Duration::from_millis(500),
        proposal_timeout: Duration::from_millis(1_000),
        ..MachineConfig::default()
    }
}

fn acked(cluster: &Cluster, id: tidings_channel::machine::RequestId) -> Vec<Seq> {
    match cluster.outcome(id) {
        Outcome::Acked(seqs) => seqs.clone(),
        other => panic!("request {id:?} not acked: {other:?}\n{}", cluster.trace.join("\n")),
    }
}

#[test]
fn single_replica_commits_through_the_same_path() {
    let mut cluster = Cluster::new(1, 1, 1, quiet(), config());
    cluster.run_for(50);
    let id = cluster.append(node(1), &["hello", "world"], &[]).unwrap();
    cluster.run_for(50);
    // Seq 1 is the leader's barrier; messages follow it.
    assert_eq!(acked(&cluster, id), vec![Seq::new(2), Seq::new(3)]);
    assert_eq!(cluster.machine(node(1)).hw(), Seq::new(3));
    let messages = cluster.committed_messages();
    assert_eq!(messages.iter().map(|(s, _)| s.get()).collect::<Vec<_>>(), vec![2, 3]);
}

#[test]
fn three_replicas_commit_in_order_and_converge() {
    let mut cluster = Cluster::new(2, 3, 2, quiet(), config());
    cluster.run_for(100);
    let mut ids = Vec::new();
    for i in 0..50 {
        let payload = format!("m{i}");
        ids.push(cluster.append(node(1), &[payload.as_str()], &[]).unwrap());
        cluster.run_for(2);
    }
    cluster.run_for(500);
    let mut last = Seq::new(0);
    for id in ids {
        let seq = acked(&cluster, id)[0];
        assert!(seq > last, "acks out of submission order");
        last = seq;
    }
    for n in 1..=3 {
        assert_eq!(cluster.machine(node(n)).hw(), last, "replica {n} HW");
    }
    cluster.check_converged();
}

#[test]
fn non_leaders_refuse_with_a_leader_hint() {
    let mut cluster = Cluster::new(3, 3, 2, quiet(), config());
    cluster.run_for(100);
    assert_eq!(cluster.append(node(2), &["x"], &[]), Err(AppendError::NotLeader { leader: Some(node(1)) }));
    assert_eq!(cluster.machine(node(2)).role(), RoleKind::Follower);
}

#[test]
fn admission_refusals_change_nothing() {
    let mut config = config();
    config.request_records_max = 4;
    config.request_bytes_max = 8;
    config.pending_records_max = 6;
    config.handoff_slots = 8;
    let mut cluster = Cluster::new(4, 3, 2, quiet(), config);
    cluster.run_for(100);
    assert_eq!(cluster.append(node(1), &[], &[]), Err(AppendError::Empty));
    assert!(matches!(cluster.append(node(1), &["a"; 5], &[]), Err(AppendError::TooLarge { .. })));
    let end = cluster.machine(node(1)).log_end();
    assert_eq!(
        cluster.append(node(1), &["12345", "6789"], &[]),
        Err(AppendError::RequestTooLarge { bytes: 9, max: 8 })
    );
    assert_eq!(cluster.machine(node(1)).log_end(), end, "an oversized request writes nothing");
    // Followers unreachable: nothing commits, so the pending bound fills up.
    cluster.blocked.insert((node(2), node(1)));
    cluster.blocked.insert((node(3), node(1)));
    cluster.append(node(1), &["a"; 4], &[]).unwrap();
    let end = cluster.machine(node(1)).log_end();
    assert_eq!(cluster.append(node(1), &["b"; 3], &[]), Err(AppendError::Busy));
    assert_eq!(cluster.machine(node(1)).log_end(), end, "a refused append assigns nothing");
    // After the alive window, the leader refuses outright: fewer than MinISR ISR members alive.
    cluster.run_for(2_500);
    assert!(matches!(
        cluster.append(node(1), &["c"], &[]),
        Err(AppendError::NotEnoughReplicas { alive: 1, min_isr: 2 })
    ));
}

#[test]
fn a_healthy_idle_follower_keeps_counting_as_alive() {
    // Idle followers pull every 200 ms park + 1.5 s wait: 1.7 s of silence at most, inside the 2 s window.
    let config = MachineConfig { idle_pull_interval: Duration::from_millis(1_500), ..config() };
    assert!(config.validate().is_ok());
    let mut cluster = Cluster::new(41, 3, 2, quiet(), config.clone());
    cluster.run_for(100);
    // Appends after quiet spells of different lengths land at every phase of the followers' idle cycle.
    for spell in 0..24u64 {
        cluster.run_for(2_000 + spell * 113);
        let appended = cluster.append(node(1), &["after a quiet spell"], &[]);
        assert!(appended.is_ok(), "quiet spell {spell}: {appended:?}\n{}", cluster.trace.join("\n"));
    }
    // A window shorter than that silence is refused up front: such followers would count as dead at times.
    let too_short = MachineConfig { isr_alive: Duration::from_millis(1_700), ..config };
    assert!(too_short.validate().is_err());
}

#[test]
fn handoff_capacity_is_reserved_before_anything_is_written() {
    let mut config = config();
    config.request_records_max = 4;
    config.handoff_slots = 4;
    let mut cluster = Cluster::new(5, 1, 1, quiet(), config);
    cluster.run_for(20);
    // The harness releases handoff slots as soon as records commit; hold them by not running.
    cluster.append(node(1), &["a"; 4], &[]).unwrap();
    let end = cluster.machine(node(1)).log_end();
    assert_eq!(cluster.append(node(1), &["b"], &[]), Err(AppendError::ChannelBusy));
    assert_eq!(cluster.machine(node(1)).log_end(), end);
    cluster.run_for(20);
    assert!(cluster.append(node(1), &["b"], &[]).is_ok(), "slots return once fanout takes the records");
}

#[test]
fn write_fence_refuses_appends_until_newer_meta_clears_it() {
    let mut cluster = Cluster::new(6, 3, 2, quiet(), config());
    cluster.run_for(100);
    let before = cluster.append(node(1), &["before"], &[]).unwrap();
    let mut fenced = cluster.meta.clone();
    fenced.version += 1;
    fenced.write_fence = Some(WriteFence { task: 7, since_version: fenced.version, freeze_replication: false });
    cluster.publish(fenced);
    cluster.deliver_meta_now(node(1));
    assert_eq!(cluster.append(node(1), &["x"], &[]), Err(AppendError::Fenced { task: 7 }));
    // In-flight work drains under the fence.
    cluster.run_for(200);
    acked(&cluster, before);
    assert!(cluster.machine(node(1)).drain_status().drained);
    // Time alone never reopens writes.
    cluster.run_for(60_000);
    assert_eq!(cluster.append(node(1), &["x"], &[]), Err(AppendError::Fenced { task: 7 }));
    let mut open = cluster.meta.clone();
    open.version += 1;
    open.write_fence = None;
    cluster.publish(open);
    cluster.deliver_meta_now(node(1));
    let after = cluster.append(node(1), &["after"], &[]).unwrap();
    cluster.run_for(200);
    acked(&cluster, after);
}

#[test]
fn idempotent_retries_return_the_original_seq_even_after_failover() {
    let mut cluster = Cluster::new(7, 3, 2, quiet(), config());
    cluster.run_for(100);
    let first = cluster.append(node(1), &["hello"], &[Some("alice:1")]).unwrap();
    cluster.run_for(100);
    let seq = acked(&cluster, first)[0];
    let retry = cluster.append(node(1), &["hello"], &[Some("alice:1")]).unwrap();
    cluster.run_for(10);
    assert_eq!(acked(&cluster, retry), vec![seq]);
    assert_eq!(cluster.append(node(1), &["other"], &[Some("alice:1")]), Err(AppendError::IdempotencyConflict));
    // Same key twice inside one request: one record.
    let twice = cluster.append(node(1), &["x", "x"], &[Some("bob:1"), Some("bob:1")]).unwrap();
    cluster.run_for(100);
    let seqs = acked(&cluster, twice);
    assert_eq!(seqs[0], seqs[1]);
    // One key on two payloads inside one request: refused whole, its new records with it.
    let clash = cluster.append(node(1), &["new", "y", "z"], &[None, Some("carol:1"), Some("carol:1")]);
    assert_eq!(clash, Err(AppendError::IdempotencyConflict));
    // Failover: the new leader knows the key from its own copy of the log.
    cluster.crash(node(1));
    let leader = cluster.failover(&[node(1)], None, None).unwrap();
    cluster.run_for(300);
    let after = cluster.append(leader, &["hello"], &[Some("alice:1")]).unwrap();
    cluster.run_for(300);
    assert_eq!(acked(&cluster, after), vec![seq]);
    assert_eq!(cluster.committed_messages().len(), 2, "no duplicate record, nothing of the refused request");
}

#[test]
fn learners_replicate_but_never_count_and_expand_with_proof() {
    let mut cluster = Cluster::new(8, 3, 2, quiet(), config());
    cluster.accept_proposals = false;
    // Node 3 is a learner: replica, not in ISR.
    let mut meta = cluster.meta.clone();
    meta.version += 1;
    meta.isr.retain(|n| *n != node(3));
    meta.epoch = meta.epoch.next();
    cluster.publish(meta);
    cluster.run_for(100);
    assert_eq!(cluster.machine(node(3)).role(), RoleKind::Learner);
    // With node 2 cut off, the learner's copy must not commit anything (MinISR 2 of ISR {1, 2}).
    cluster.blocked.insert((node(2), node(1)));
    cluster.blocked.insert((node(1), node(2)));
    let id = cluster.append(node(1), &["m"], &[]).unwrap();
    cluster.run_for(1_000);
    assert_eq!(*cluster.outcome(id), Outcome::Pending);
    let end = cluster.machine(node(1)).log_end();
    assert_eq!(cluster.machine(node(3)).durable_last(), end, "learner replicated everything");
    assert!(cluster.machine(node(1)).hw() < end);
    // Once the slot layer accepts the leader's proposal (the learner proved it holds the whole log under
    // this leader), it counts, and the append commits even with node 2 still cut off.
    cluster.accept_proposals = true;
    cluster.run_for(6_000);
    assert!(cluster.meta.in_isr(node(3)), "learner not expanded into ISR: {:?}", cluster.meta);
    acked(&cluster, id);
}

#[test]
fn lagging_follower_is_shrunk_out_of_the_isr_never_below_min_isr() {
    let mut cluster = Cluster::new(9, 3, 2, quiet(), config());
    cluster.run_for(100);
    cluster.crash(node(3));
    for i in 0..10 {
        let payload = format!("m{i}");
        cluster.append(node(1), &[payload.as_str()], &[]).unwrap();
        cluster.run_for(500);
    }
    assert_eq!(cluster.meta.isr.len(), 2, "node 3 shrunk out: {:?}", cluster.meta.isr);
    assert!(!cluster.meta.in_isr(node(3)));
    cluster.crash(node(2));
    cluster.run_for(10_000);
    assert_eq!(cluster.meta.isr.len(), 2, "never below MinISR");
}

#[test]
fn a_new_leader_keeps_in_the_isr_the_members_holding_what_its_predecessor_may_have_committed() {
    // Sim seed 564000374: leader 5 committed #6 on itself and node 4 (MinISR 2 of ISR [5, 3, 4]), node 4
    // took over having heard HW 5 only, and shrank node 5 out while node 3 still lacked #6: by node 4's
    // HW, it and node 3 held everything committed. ISR [3, 4] then needed one member's evidence, node 3's
    // won a failover, and #6 was overwritten. Here: node 1 commits a record on itself and node 2 while
    // node 3 hears nothing from it; node 2 takes over before the HW news reaches it, and node 3's pulls
    // reach node 2 but no answer comes back.
    let hw_news_late = MachineConfig { hw_notify_delay: Duration::from_secs(2), ..config() };
    let mut cluster = Cluster::new(43, 3, 2, quiet(), hw_news_late);
    cluster.run_for(300);
    cluster.blocked.insert((node(1), node(3)));
    let id = cluster.append(node(1), &["committed by node 1"], &[]).unwrap();
    cluster.run_until_cond(500, |c| matches!(c.outcome(id), Outcome::Acked(_)));
    let committed = acked(&cluster, id)[0];
    assert!(cluster.machine(node(2)).hw() < committed, "node 2 is not told yet");
    assert!(cluster.machine(node(3)).durable_last() < committed, "node 3 lacks it");
    cluster.crash(node(1));
    cluster.blocked.insert((node(2), node(3)));
    assert_eq!(cluster.failover(&[node(1)], None, None), Some(node(2)), "node 2 holds the longest log");
    // Past the ISR lag bound, node 1 (down) and node 3 (behind) lag; taking out either would leave the
    // record on fewer than MinISR of the ISR.
    cluster.run_for(5_000);
    assert_eq!(cluster.meta.isr.len(), 3, "no member shrunk out: {:?}", cluster.meta.isr);
    // So a failover without node 2 cannot elect node 3 alone (the invariants check the leader holds
    // every committed record at every step).
    cluster.crash(node(2));
    assert_eq!(cluster.failover(&[node(2)], None, None), None, "node 3's evidence alone is not enough");
    cluster.run_for(1_000);
    cluster.check_invariants();
}

/// A three-node cluster (MinISR 2) whose leader, node 1, proposes dropping node 3 (cut off) from the
/// ISR: the slot layer takes it (v2: ISR [1, 2]) and the answer never reaches the leader.
fn a_leader_that_never_heard_its_shrink_commit(seed: u64) -> Cluster {
    let mut cluster = Cluster::new(seed, 3, 2, quiet(), config());
    cluster.run_for(100);
    cluster.meta_unheard.insert(node(1));
    cluster.isolate(node(3), &[node(1), node(2)]);
    for i in 0..40 {
        let payload = format!("a{i}");
        cluster.append(node(1), &[payload.as_str()], &[]).unwrap();
        cluster.run_for(100);
    }
    assert_eq!(cluster.meta.isr, vec![node(1), node(2)], "node 3 shrunk out in the meta in force");
    assert_eq!(cluster.machine(node(1)).meta().map(|m| m.version), Some(1), "the leader never heard it");
    cluster
}

/// Node 3 comes back and node 2 is cut off while node 1 takes appends: with ISR [1, 2] in force and
/// MinISR 2, nothing past what node 2 holds may commit, however far node 3 gets.
fn commits_stay_within_node_2_once_it_is_cut_off(mut cluster: Cluster) {
    cluster.blocked.clear();
    cluster.isolate(node(2), &[node(1), node(3)]);
    let node_2_holds = cluster.machine(node(2)).durable_last();
    for i in 0..60 {
        let payload = format!("b{i}");
        let _ = cluster.append(node(1), &[payload.as_str()], &[]);
        cluster.run_for(100);
    }
    assert!(cluster.machine(node(3)).durable_last() > node_2_holds, "node 3 took records while node 2 was cut off");
    let hw = cluster.machine(node(1)).hw();
    assert!(hw <= node_2_holds, "leader HW {hw:?} past node 2's {node_2_holds:?}\n{}", cluster.trace.join("\n"));
    cluster.check_invariants();
}

#[test]
fn a_leader_that_missed_its_committed_shrink_counts_hw_under_every_isr_it_proposed() {
    // Sim seed 241005257: a leader proposed dropping node 3, the slot layer took it (v2: ISR [1, 2]) and
    // the answer never reached the leader. Later, with node 2 cut off and node 3 back, it proposed
    // dropping node 2 from the old version. Counting HW under that last proposal alone, it committed
    // records that node 2 — half of the ISR in force — never had.
    commits_stay_within_node_2_once_it_is_cut_off(a_leader_that_never_heard_its_shrink_commit(41));
}

#[test]
fn a_leader_back_under_the_meta_it_proposed_a_shrink_from_counts_hw_under_that_shrink() {
    // Sim seed 612000817: as above, but the leader was then evicted and built again under the meta its
    // node still held (v1: ISR [1, 2, 3]). Its new incarnation knew nothing of the shrink, committed a
    // record on itself and node 3, and a failover on node 2's evidence (half of the ISR in force) lost
    // it. The shrink's record in the leader's log (`ChannelLogState::isr_proposals`) tells the next
    // incarnation.
    let mut cluster = a_leader_that_never_heard_its_shrink_commit(47);
    let stale = cluster.machine(node(1)).meta().cloned().expect("the leader has a meta");
    let recorded = &cluster.machine(node(1)).durable_state().isr_proposals;
    assert_eq!(recorded, &vec![(1, vec![node(1), node(2)])], "the shrink is in the leader's log");
    cluster.run_until_cond(10_000, |c| c.machine(node(1)).is_quiescent());
    cluster.evict_and_resume_under(node(1), stale);
    commits_stay_within_node_2_once_it_is_cut_off(cluster);
}

#[test]
fn a_replica_is_quiescent_only_once_its_hw_is_checkpointed() {
    // An evicted replica comes back from its checkpoint: evicting it with a newer HW in memory would have
    // its HW go back (the simulator saw it once replicas were evicted within a second of a commit).
    let mut cluster = Cluster::new(3, 3, 2, quiet(), MachineConfig { hw_notify_delay: Duration::ZERO, ..config() });
    cluster.run_for(300);
    let first = cluster.append(node(1), &["a"], &[]).unwrap();
    cluster.run_for(1_500);
    acked(&cluster, first);
    for n in 1..=3 {
        assert!(cluster.machine(node(n)).is_quiescent(), "node {n} idle and checkpointed");
    }
    // Two commits in a row: the second one's HW waits up to a second for its checkpoint.
    let second = cluster.append(node(1), &["b"], &[]).unwrap();
    cluster.run_for(100);
    acked(&cluster, second);
    let third = cluster.append(node(1), &["c"], &[]).unwrap();
    cluster.run_for(20);
    let c = acked(&cluster, third)[0];
    assert_eq!(cluster.machine(node(1)).hw(), c);
    assert!(!cluster.machine(node(1)).is_quiescent(), "committed, but its HW not yet checkpointed");
    cluster.run_for(1_200);
    for n in 1..=3 {
        assert!(cluster.machine(node(n)).is_quiescent(), "node {n} once its checkpoint is written");
    }
}

#[test]
fn with_hw_news_not_held_followers_learn_each_commit_at_once() {
    let mut cluster = Cluster::new(3, 3, 2, quiet(), MachineConfig { hw_notify_delay: Duration::ZERO, ..config() });
    cluster.run_for(300);
    for payload in ["a", "b"] {
        let id = cluster.append(node(1), &[payload], &[]).unwrap();
        cluster.run_for(20);
        let seq = acked(&cluster, id)[0];
        for n in 2..=3 {
            assert_eq!(cluster.machine(node(n)).hw(), seq, "follower {n} not told of {payload} at once");
        }
    }
    cluster.check_converged();
}

#[test]
fn held_back_hw_news_delays_no_commit_and_reaches_followers_with_the_next_records_or_by_the_delay() {
    let delay = Duration::from_millis(150);
    let mut cluster = Cluster::new(3, 3, 2, quiet(), MachineConfig { hw_notify_delay: delay, ..config() });
    cluster.run_for(300);
    let first = cluster.append(node(1), &["a"], &[]).unwrap();
    cluster.run_for(20);
    // Committed within a few round trips: the delay holds back only what followers are told.
    let a = acked(&cluster, first)[0];
    assert_eq!(cluster.machine(node(1)).hw(), a);
    for n in 2..=3 {
        assert!(cluster.machine(node(n)).hw() < a, "follower {n} was told at once");
    }
    // The next records carry the HW that covers `a`, well before the delay ran out.
    let second = cluster.append(node(1), &["b"], &[]).unwrap();
    cluster.run_for(20);
    let b = acked(&cluster, second)[0];
    for n in 2..=3 {
        let hw = cluster.machine(node(n)).hw();
        assert!(hw >= a && hw < b, "follower {n} HW {hw:?} after the second append");
    }
    // With nothing more to send, followers learn `b` once the delay ran out.
    cluster.run_for(u64::try_from(delay.as_millis()).unwrap() + 20);
    for n in 2..=3 {
        assert_eq!(cluster.machine(node(n)).hw(), b, "follower {n} after the delay");
    }
    cluster.check_converged();
}

#[test]
fn the_leader_reports_each_replicas_lag_and_silence() {
    let mut cluster = Cluster::new(31, 3, 2, quiet(), config());
    cluster.run_for(100);
    cluster.append_each(node(1), 5);
    cluster.run_for(100);
    let leader = cluster.machine(node(1));
    let progress = leader.replica_progress(cluster.now);
    assert_eq!(progress.iter().map(|p| p.node).collect::<Vec<_>>(), vec![node(2), node(3)]);
    for p in &progress {
        assert!(p.in_isr);
        assert_eq!((p.match_seq, p.lag, p.behind_for), (leader.log_end(), 0, Duration::ZERO), "{p:?}");
        assert!(p.silent_for <= config().pull_park, "a caught-up follower pulls within its long poll: {p:?}");
    }
    assert!(cluster.machine(node(2)).replica_progress(cluster.now).is_empty(), "only the leader reports");

    // Node 3 stops hearing anything; three more records commit on nodes 1 and 2.
    cluster.crash(node(3));
    for i in 0..3 {
        let payload = format!("n{i}");
        cluster.append(node(1), &[payload.as_str()], &[]).unwrap();
    }
    cluster.run_for(1_000);
    let leader = cluster.machine(node(1));
    let progress = leader.replica_progress(cluster.now);
    assert_eq!((progress[0].lag, progress[0].behind_for), (0, Duration::ZERO), "node 2 keeps up: {progress:?}");
    let silent = &progress[1];
    assert_eq!(silent.lag, 3, "three records past its last acknowledgement: {silent:?}");
    assert!(silent.in_isr, "still within isr_lag: {silent:?}");
    assert!(silent.behind_for >= Duration::from_millis(900), "behind since the first of them: {silent:?}");
    assert!(silent.silent_for >= Duration::from_millis(800), "no pull since the crash: {silent:?}");
}

#[test]
fn the_leader_gives_up_committed_records_through_the_meta_and_every_replica_trims_them() {
    let mut cluster = Cluster::new(41, 3, 2, quiet(), config());
    cluster.run_for(100);
    cluster.append_each(node(1), 10);
    cluster.run_for(500);
    let hw = cluster.machine(node(1)).hw();
    let through = Seq::new(6);

    // Refused at admission, nothing proposed: past HW, or not at the leader.
    let beyond = Seq::new(hw.get() + 1);
    assert_eq!(cluster.retain(node(1), beyond), Err(AppendError::BeyondHw { through: beyond, hw }));
    assert_eq!(cluster.retain(node(2), through), Err(AppendError::NotLeader { leader: Some(node(1)) }));
    assert_eq!(cluster.meta.retention_through, Seq::new(0));

    let id = cluster.retain(node(1), through).unwrap();
    // Well within the 1 s an idle replica takes to checkpoint its HW: each one trims as it applies the meta.
    cluster.run_for(100);
    assert_eq!(cluster.retentions[&id], Some(Ok(through)), "done once the meta is in force");
    assert_eq!(cluster.meta.retention_through, through, "the boundary is the slot layer's meta");
    for n in 1..=3 {
        let records = cluster.durable_records(node(n));
        assert!(records.iter().all(|r| r.seq > through), "node {n} trimmed its log: {records:?}");
        assert_eq!(records.last().map(|r| r.seq), Some(hw), "node {n} keeps what follows");
    }
    // A boundary at or below the one in force is answered at once; it never moves back.
    let again = cluster.retain(node(1), Seq::new(3)).unwrap();
    assert_eq!(cluster.retentions[&again], Some(Ok(through)));
    // The channel goes on: appends commit and followers keep replicating past the boundary.
    let later = cluster.append(node(1), &["after"], &[]).unwrap();
    cluster.run_for(500);
    assert_eq!(acked(&cluster, later), vec![hw.next()]);
    cluster.check_converged();
}

#[test]
fn a_retention_move_the_slot_layer_never_applies_times_out() {
    let mut cluster = Cluster::new(43, 3, 2, quiet(), config());
    cluster.run_for(100);
    cluster.append(node(1), &["a", "b", "c"], &[]).unwrap();
    cluster.run_for(200);
    cluster.accept_proposals = false;
    let id = cluster.retain(node(1), Seq::new(2)).unwrap();
    cluster.run_for(u64::try_from(config().append_timeout.as_millis()).unwrap() + 100);
    assert_eq!(cluster.retentions[&id], Some(Err(tidings_channel::machine::AppendAborted::Timeout)));
    assert_eq!(cluster.meta.retention_through, Seq::new(0));
}

/// `count` messages committed on node 1 of `n` replicas, their fanout held (not finished): the cluster
/// and their seqs.
fn committed_with_fanout_held(seed: u64, n: u64, min_isr: u8, count: usize) -> (Cluster, Vec<Seq>) {
    let mut cluster = Cluster::new(seed, n, min_isr, quiet(), config());
    cluster.fanout_held = true;
    cluster.run_for(100);
    let ids = cluster.append_each(node(1), count);
    cluster.run_for(300);
    let seqs: Vec<Seq> = ids.iter().map(|id| acked(&cluster, *id)[0]).collect();
    assert_eq!(cluster.fanning[&node(1)], seqs, "each committed message handed off once, in order");
    (cluster, seqs)
}

/// The leader's fanout of the messages it committed is slow, and it crashes half way: its successor
/// fans out again exactly those whose end the followers had not heard of.
#[test]
fn a_new_leader_fans_out_again_what_its_crashed_predecessor_had_not_finished() {
    let (mut cluster, seqs) = committed_with_fanout_held(31, 3, 2, 6);
    // Fanout ends for the first five (delivered, or failed for good); the sixth is slow.
    cluster.finish_fanout(node(1), &seqs[..5]);
    // Followers hear of it with the leader's next answer (a parked pull ends within `pull_park`).
    cluster.run_for(500);
    cluster.crash(node(1));
    let leader = cluster.failover(&[node(1)], None, None).expect("two of three replicas report");
    cluster.run_for(500);
    let refanned = cluster.handed_off_by(leader);
    assert_eq!(
        refanned,
        vec![seqs[5]],
        "only the unfinished message goes to fanout again\n{}",
        cluster.trace.join("\n")
    );
    // Its fanout is the new leader's now: finishing it is reported onwards.
    cluster.finish_fanout(leader, &refanned);
    let id = cluster.append(leader, &["after"], &[]).unwrap();
    cluster.run_for(300);
    let after = acked(&cluster, id)[0];
    assert_eq!(cluster.handed_off_by(leader), vec![seqs[5], after], "its own message follows, the barrier is none");
}

/// Records the crashed leader admitted but never saw commit are committed by its successor, which fans
/// them out; with fanout finishing at once every committed message went to fanout somewhere.
#[test]
fn messages_a_successor_commits_for_a_crashed_leader_fan_out_there() {
    // MinISR 3 and node 3 cut off: the leader and node 2 hold the records, and nothing commits.
    let mut cluster = Cluster::new(32, 3, 3, quiet(), config());
    cluster.run_for(100);
    cluster.isolate(node(3), &[node(1), node(2)]);
    let ids = cluster.append_each(node(1), 3);
    cluster.run_for(100);
    assert_eq!(cluster.durable_records(node(2)).len(), 4, "the barrier and the three records reached node 2");
    assert!(ids.iter().all(|id| *cluster.outcome(*id) == Outcome::Pending), "nothing committed yet");
    cluster.crash(node(1));
    cluster.blocked.clear();
    let leader = cluster.failover(&[node(1)], Some(vec![node(2), node(3)]), Some(2)).expect("both report");
    assert_eq!(leader, node(2), "the replica holding the records leads");
    cluster.run_for(500);
    let inherited: Vec<Seq> = cluster.committed_messages().iter().map(|(seq, _)| *seq).collect();
    assert_eq!(inherited.len(), 3, "the successor committed the three records it held");
    assert_eq!(cluster.handed_off_by(leader), inherited, "and fanned them out");
    cluster.check_every_committed_message_handed_off();
}

/// How far fanout finished is checkpointed with the log: a replica that restarts and leads again fans
/// out again only what had not finished before the crash.
#[test]
fn a_leader_restarted_from_its_disk_fans_out_again_only_what_had_not_finished() {
    let (mut cluster, seqs) = committed_with_fanout_held(33, 1, 1, 4);
    cluster.finish_fanout(node(1), &seqs[..2]);
    // The progress is checkpointed like HW (within about a second when nothing else is written).
    cluster.run_for(1_500);
    assert_eq!(cluster.replicas[&node(1)].log.state(&harness::channel()).unwrap().fanned_through, seqs[1]);
    cluster.crash(node(1));
    // It may not lead again in the epoch it held: the controller fails over, to it, in a new one.
    cluster.start(node(1));
    cluster.run_for(300);
    assert_eq!(cluster.machine(node(1)).role(), RoleKind::Leader);
    let refanned = cluster.handed_off_by(node(1))[seqs.len()..].to_vec();
    assert_eq!(refanned, seqs[2..].to_vec(), "handed off after the restart\n{}", cluster.trace.join("\n"));
}

/// A leader evicted while quiescent resumes its epoch without a second barrier: each leader epoch
/// holds one barrier, at its start, so a successor tells barriers from messages by the epoch history.
#[test]
fn a_leadership_resumed_after_an_eviction_writes_no_second_barrier() {
    let mut cluster = Cluster::new(34, 3, 2, quiet(), config());
    cluster.run_for(100);
    cluster.append_each(node(1), 3);
    // Quiescent: committed, durable, and HW checkpointed everywhere.
    cluster.run_for(2_000);
    cluster.evict_and_resume(node(1));
    assert_eq!(cluster.machine(node(1)).role(), RoleKind::Leader);
    let id = cluster.append(node(1), &["after the eviction"], &[]).unwrap();
    cluster.run_for(300);
    assert_eq!(acked(&cluster, id), vec![Seq::new(5)], "the next seq after barrier #1 and messages #2-#4");
    let barriers: Vec<Seq> = cluster
        .durable_records(node(1))
        .iter()
        .filter(|r| r.kind == tidings_store::message::RecordKind::Barrier)
        .map(|r| r.seq)
        .collect();
    assert_eq!(barriers, vec![Seq::new(1)]);
    cluster.check_converged();
}

/// A leader that steps down alive (its successor chosen without it) hands its unfinished fanout over:
/// it stops planning those messages, their slots are free, and the successor plans them once.
#[test]
fn a_leader_that_steps_down_hands_its_unfinished_fanout_over_to_its_successor() {
    let (mut cluster, seqs) = committed_with_fanout_held(35, 3, 2, 4);
    cluster.finish_fanout(node(1), &seqs[..2]);
    cluster.run_for(500);
    let leader = cluster.failover(&[node(1)], None, None).expect("nodes 2 and 3 report");
    cluster.run_for(500);
    assert_ne!(leader, node(1));
    assert!(!cluster.fanning.contains_key(&node(1)), "node 1 plans none of them any more");
    assert_eq!(cluster.handed_off_by(leader), seqs[2..].to_vec(), "its successor plans them");
    cluster.finish_fanout(leader, &seqs[2..]);
    cluster.run_for(2_000);
    assert!(cluster.machine(node(1)).is_quiescent(), "no handoff slot stays held on node 1");
}
