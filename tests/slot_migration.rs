//! Hash-slot migration through the node API, on a virtual-time cluster: the copy while writes go on,
//! the fence, the keys written meanwhile, the hand-over and the clean-up; writes routed by stale tables
//! following the slot; refusals and abort; a crash of the source's or the target's leader mid-way. Every
//! acknowledged write must be at the new owner, once.

mod support;

use std::collections::BTreeSet;
use support::{force_meta, with_fence, Cluster};
use tidings::node::{ApiId, MigrationPhase};
use tidings::router::hash_slot;
use tidings::slot::command::{Command, RoutingKey};
use tidings::slot::model::{SlotMigrationStep, SlotState, Uid, User};
use tidings::store::{FailOp, Keyspace, MetaSpace};
use tidings::types::{ChannelId, ChannelType, GroupId, HashSlot, NodeId};

/// A settled 4-node cluster copying slots in small chunks with a pause between steps (the copy takes long
/// enough for writes to interleave), and a load of `users` users of the slot.
fn slow_copy_cluster(chunk_bytes: usize, users: usize) -> (Cluster, Load) {
    let mut cluster = Cluster::with(4, |config| {
        config.controller.migration_chunk_bytes = chunk_bytes;
        config.controller.migration_step_pause = std::time::Duration::from_millis(15);
    });
    cluster.run_for(3_000);
    (cluster, Load::new(users))
}

const SOURCE: GroupId = GroupId::new(1);
const TARGET: GroupId = GroupId::new(2);

/// A slot of the source group in the genesis table (4 groups: group 1 owns slots 0-63).
fn the_slot() -> HashSlot {
    HashSlot::new(9).unwrap()
}

/// `count` distinct uids whose hash slot is `slot`, starting the search at `from`.
fn uids_in(slot: HashSlot, from: u64, count: usize) -> Vec<Uid> {
    (from..)
        .map(|i| Uid::new(format!("user-{i}")).unwrap())
        .filter(|u| hash_slot(u.as_str().as_bytes()) == slot)
        .take(count)
        .collect()
}

/// User writes to the migrating slot through rotating nodes; a write refused while the slot is fenced
/// (or for want of a leader) is written again, as a caller would.
struct Load {
    uids: Vec<Uid>,
    next: usize,
    issued: Vec<(ApiId, Uid)>,
    retried: u64,
}

impl Load {
    fn new(count: usize) -> Self {
        Self { uids: uids_in(the_slot(), 0, count), next: 0, issued: Vec::new(), retried: 0 }
    }

    fn step(&mut self, cluster: &mut Cluster) {
        let fenced: Vec<usize> = self
            .issued
            .iter()
            .enumerate()
            .filter(|(_, (id, _))| cluster.results.get(id).is_some_and(|r| RETRYABLE.iter().any(|e| r.contains(e))))
            .map(|(i, _)| i)
            .collect();
        for i in fenced.into_iter().rev() {
            let (_, uid) = self.issued.remove(i);
            self.retried += 1;
            self.write(cluster, uid);
        }
        if self.next < self.uids.len() {
            let uid = self.uids[self.next].clone();
            self.next += 1;
            self.write(cluster, uid);
        }
    }

    /// `steps` steps, `step_ms` apart.
    fn run(&mut self, cluster: &mut Cluster, steps: usize, step_ms: u64) {
        for _ in 0..steps {
            self.step(cluster);
            cluster.run_for(step_ms);
        }
    }

    /// Steps until every user was written once, `step_ms` apart.
    fn write_all(&mut self, cluster: &mut Cluster, step_ms: u64) {
        while self.next < self.uids.len() {
            self.step(cluster);
            cluster.run_for(step_ms);
        }
    }

    fn write(&mut self, cluster: &mut Cluster, uid: Uid) {
        let via = 1 + (self.issued.len() as u64 % 4);
        if cluster.nodes[&NodeId::new(via)].core.is_none() {
            return;
        }
        let id = cluster.api();
        let now = cluster.now;
        let user = User { uid: uid.clone(), name: format!("name of {}", uid.as_str()), banned: false };
        cluster.core(via).propose(now, id, Command::PutUser(user));
        self.issued.push((id, uid));
    }

    fn acknowledged(&self, cluster: &Cluster) -> BTreeSet<Uid> {
        self.issued
            .iter()
            .filter(|(id, _)| cluster.results.get(id).map(String::as_str) == Some("Meta(Ok(()))"))
            .map(|(_, uid)| uid.clone())
            .collect()
    }
}

/// Failures a caller writes again.
const RETRYABLE: [&str; 4] = ["SlotFenced", "NotLeader", "NotReady", "Timeout"];

fn run_loaded(cluster: &mut Cluster, load: &mut Load, ms: u64, done: impl Fn(&mut Cluster) -> bool) -> bool {
    for _ in 0..ms / 20 {
        if done(cluster) {
            return true;
        }
        load.step(cluster);
        cluster.run_for(20);
    }
    done(cluster)
}

/// The records of both groups on their leaders show the slot handed over at `epoch`.
fn migrated(cluster: &mut Cluster, epoch: u64) -> bool {
    let (Some(s), Some(t)) = (cluster.slot_leader(SOURCE), cluster.slot_leader(TARGET)) else { return false };
    let source = cluster.core(s).reader().slot_record(SOURCE, the_slot()).ok().flatten();
    let target = cluster.core(t).reader().slot_record(TARGET, the_slot()).ok().flatten();
    source.is_some_and(|r| r.epoch == epoch && r.state == SlotState::Gone { to: TARGET })
        && target.is_some_and(|r| r.epoch == epoch && r.state == SlotState::Owned)
}

fn voters(cluster: &mut Cluster, group: GroupId) -> Vec<u64> {
    let leader = cluster.slot_leader(group).expect("group has a leader");
    cluster.core(leader).slot().status(group).unwrap().voters.iter().map(|n| n.get()).collect()
}

/// Every acknowledged write is on every voter of the target, in the target's copy, and the source's copy
/// of the slot is gone everywhere.
fn check_moved(cluster: &mut Cluster, load: &Load) {
    let acked = load.acknowledged(cluster);
    assert!(acked.len() > 20, "the load made progress ({} acknowledged)", acked.len());
    for voter in voters(cluster, TARGET) {
        let reader = cluster.core(voter).reader();
        for uid in &acked {
            let user = reader.user(uid).unwrap();
            assert!(user.is_some(), "{} acknowledged but missing on node {voter} of the target", uid.as_str());
        }
    }
    for node in voters(cluster, SOURCE) {
        let left = cluster.core(node).reader().export_slot(SOURCE, the_slot(), None, usize::MAX).unwrap();
        assert!(left.items.is_empty(), "node {node} still holds the source's copy");
    }
}

fn start(cluster: &mut Cluster, via: u64) {
    let slot = the_slot();
    assert_eq!(cluster.call(via, |core, now, id| core.migrate_slot(now, id, slot, TARGET)), "Meta(Ok(()))");
}

#[test]
fn a_slot_migrates_under_write_load_and_every_acknowledged_write_is_at_its_new_group() {
    let (mut cluster, mut load) = slow_copy_cluster(600, 400);
    load.run(&mut cluster, 100, 20);
    start(&mut cluster, 3);
    let done = run_loaded(&mut cluster, &mut load, 30_000, |c| migrated(c, 1));
    assert!(done, "the migration completes");
    load.write_all(&mut cluster, 20);
    cluster.run_for(3_000);
    load.step(&mut cluster);
    cluster.run_for(3_000);
    let failed: Vec<&String> = load
        .issued
        .iter()
        .filter_map(|(id, _)| cluster.results.get(id))
        .filter(|r| r.as_str() != "Meta(Ok(()))")
        .collect();
    assert!(failed.is_empty(), "every write is acknowledged in the end: {failed:?}");
    let l = cluster.slot_leader(SOURCE).unwrap();
    assert!(cluster.core(l).status().slot_migrations.is_empty(), "no export left behind");
    assert!(load.retried > 0, "some writes met the fence and were written again");
    check_moved(&mut cluster, &load);
    // Every node routes the slot to the target now (members of either group learned it from the
    // migration; the others from a stale-route answer, or they learn on their next write).
    for node in 1..=4u64 {
        let uid = uids_in(the_slot(), 100_000 + node * 1000, 1).remove(0);
        let user = User { uid: uid.clone(), name: "late".into(), banned: false };
        let answer = cluster.call(node, |core, now, id| core.propose(now, id, Command::PutUser(user)));
        assert_eq!(answer, "Meta(Ok(()))", "a write through node {node} after the migration");
        assert_eq!(cluster.core(node).slot().table().group_of(the_slot()), TARGET, "node {node} routes to the target");
    }
    // Authoritative reads follow the slot too.
    let uid = load.acknowledged(&cluster).into_iter().next().unwrap();
    for node in voters(&mut cluster, TARGET) {
        let key = uid.clone();
        let answer = cluster.call(node, |core, now, id| core.read_barrier(now, id, RoutingKey::Uid(&key)));
        assert_eq!(answer, "Meta(Ok(()))");
    }
    // And a restart keeps the route and the data.
    for node in 1..=4u64 {
        cluster.crash(node);
        cluster.restart(node);
    }
    cluster.run_for(5_000);
    for node in 1..=4u64 {
        assert_eq!(cluster.core(node).slot().table().group_of(the_slot()), TARGET, "node {node} after a restart");
    }
    check_moved(&mut cluster, &load);
}

#[test]
fn migrations_are_refused_with_a_reason() {
    let mut cluster = Cluster::new(4);
    cluster.run_for(3_000);
    let slot = the_slot();
    let answer = cluster.call(1, |core, now, id| core.migrate_slot(now, id, slot, SOURCE));
    assert!(answer.contains("SameGroup"), "{answer}");
    let answer = cluster.call(1, |core, now, id| core.migrate_slot(now, id, slot, GroupId::new(9)));
    assert!(answer.contains("UnknownGroup"), "{answer}");
    let answer = cluster.call(1, |core, now, id| core.abort_slot_migration(now, id, slot));
    assert!(answer.contains("OutOfStep"), "{answer}");
    start(&mut cluster, 1);
    let answer = cluster.call(2, |core, now, id| core.migrate_slot(now, id, slot, GroupId::new(3)));
    assert!(answer.contains("NotOwned"), "a second migration of a migrating slot: {answer}");
}

#[test]
fn an_abort_before_the_fence_keeps_the_slot_where_it_was() {
    let (mut cluster, mut load) = slow_copy_cluster(200, 300);
    load.write_all(&mut cluster, 10);
    cluster.run_for(2_000);
    let slot = the_slot();
    // The abort follows at once: the copy of 300 users in 200-byte chunks is far from done.
    let (start_id, abort_id) = (cluster.api(), cluster.api());
    let now = cluster.now;
    cluster.core(1).migrate_slot(now, start_id, slot, TARGET);
    cluster.core(1).abort_slot_migration(now, abort_id, slot);
    assert!(cluster.run_until(10_000, |c| c.results.contains_key(&abort_id)));
    assert_eq!(cluster.results[&start_id], "Meta(Ok(()))");
    assert_eq!(cluster.results[&abort_id], "Meta(Ok(()))", "aborted before the fence");
    cluster.run_for(3_000);
    let l = cluster.slot_leader(SOURCE).unwrap();
    let record = cluster.core(l).reader().slot_record(SOURCE, slot).unwrap().unwrap();
    assert_eq!((record.epoch, record.state), (0, SlotState::Owned));
    assert!(cluster.core(l).status().slot_migrations.is_empty(), "the driver let go");
    // The target dropped what it had received.
    for node in voters(&mut cluster, TARGET) {
        let left = cluster.core(node).reader().export_slot(TARGET, slot, None, usize::MAX).unwrap();
        assert!(left.items.is_empty(), "node {node} keeps a partial import");
    }
    // The data is where it was, and the slot can migrate later.
    for uid in load.acknowledged(&cluster) {
        assert!(cluster.core(l).reader().user(&uid).unwrap().is_some());
    }
    start(&mut cluster, 2);
    assert!(cluster.run_until(30_000, |c| migrated(c, 1)), "a later migration completes");
    cluster.run_for(2_000);
    check_moved(&mut cluster, &load);
}

#[test]
fn a_migration_completes_after_a_crash_of_either_leader_mid_way() {
    for (victim_group, phase) in [
        (SOURCE, MigrationPhase::Begin),
        (SOURCE, MigrationPhase::Copy),
        (SOURCE, MigrationPhase::Fence),
        (SOURCE, MigrationPhase::Marks),
        (SOURCE, MigrationPhase::Finish),
        (TARGET, MigrationPhase::Copy),
        (TARGET, MigrationPhase::Commit),
    ] {
        let (mut cluster, mut load) = slow_copy_cluster(300, 500);
        load.run(&mut cluster, 150, 10);
        start(&mut cluster, 1);
        let reached = run_loaded(&mut cluster, &mut load, 20_000, |c| {
            let Some(l) = c.slot_leader(SOURCE) else { return false };
            c.core(l).status().slot_migrations.iter().any(|m| m.phase >= phase)
        });
        assert!(reached, "{victim_group} {phase:?}: the driver gets there");
        let victim = cluster.slot_leader(victim_group).unwrap();
        cluster.crash(victim);
        run_loaded(&mut cluster, &mut load, 3_000, |_| false);
        cluster.restart(victim);
        let done = run_loaded(&mut cluster, &mut load, 40_000, |c| migrated(c, 1));
        assert!(done, "{victim_group} leader {victim} crashed at {phase:?}: the migration completes");
        load.write_all(&mut cluster, 10);
        load.run(&mut cluster, 100, 30);
        cluster.run_for(3_000);
        check_moved(&mut cluster, &load);
    }
}

#[test]
fn an_import_whose_export_was_given_up_is_dropped_by_the_target() {
    // A late `BeginImport` of an abandoned attempt (or an abort whose clean-up was lost) leaves the
    // target holding an import nobody finishes: its leader asks the source's and drops it.
    let mut cluster = Cluster::new(4);
    cluster.run_for(3_000);
    let slot = the_slot();
    let step = SlotMigrationStep::BeginImport { from: SOURCE, epoch: 1, attempt: 999 };
    let begin = Command::MigrateSlot { group: TARGET, slot, step };
    assert_eq!(cluster.call(2, |core, now, id| core.propose(now, id, begin)), "Meta(Ok(()))");
    let chunk = SlotMigrationStep::ImportChunk {
        from: SOURCE,
        epoch: 1,
        attempt: 999,
        entries: vec![(b"leftover".to_vec(), Some(b"x".to_vec()))],
    };
    let chunk = Command::MigrateSlot { group: TARGET, slot, step: chunk };
    assert_eq!(cluster.call(3, |core, now, id| core.propose(now, id, chunk)), "Meta(Ok(()))");
    let importing = |c: &mut Cluster| {
        let Some(t) = c.slot_leader(TARGET) else { return true };
        let record = c.core(t).reader().slot_record(TARGET, slot).unwrap();
        record.is_some_and(|r| matches!(r.state, SlotState::Importing { .. }))
    };
    assert!(importing(&mut cluster));
    assert!(cluster.run_until(20_000, |c| !importing(c)), "the target drops the import");
    cluster.run_for(1_000);
    for node in voters(&mut cluster, TARGET) {
        let left = cluster.core(node).reader().export_slot(TARGET, slot, None, usize::MAX).unwrap();
        assert!(left.items.is_empty(), "node {node} keeps the abandoned import");
        let record = cluster.core(node).reader().slot_record(TARGET, slot).unwrap().unwrap();
        assert_eq!((record.epoch, record.state), (0, SlotState::Gone { to: SOURCE }));
    }
    // The slot still migrates there later.
    start(&mut cluster, 1);
    assert!(cluster.run_until(30_000, |c| migrated(c, 1)), "a later migration completes");
}

#[test]
fn a_fence_that_moves_with_its_slot_is_cleared_soon_by_the_new_group_s_controller() {
    // A controller that fenced a channel can fail to unfence it while the channel's slot is fenced for a
    // migration (`SlotFenced`), and give up: the fence then moves with the slot. The new group's leader
    // must look at the slots it gained at once, not at its next idle repair pass (10 s) — the simulator
    // found a channel taking no append long after everything healed (seed 105000395).
    let mut cluster = Cluster::with(4, |_| {});
    cluster.run_for(3_000);
    let channel = (0..)
        .map(|i| ChannelId::new(ChannelType::GROUP, &format!("fenced-{i}")).unwrap())
        .find(|c| hash_slot(c.route_key()) == the_slot())
        .unwrap();
    cluster.create_channel(1, &channel);
    let meta = cluster.core(1).reader().runtime_meta(&channel).unwrap().expect("created");
    force_meta(&mut cluster, 1, &meta, with_fence(&meta, 4242, false), None);
    start(&mut cluster, 1);
    assert!(cluster.run_until(5_000, |c| migrated(c, 1)), "the slot migrates");
    let cleared = cluster.run_until(8_000, |c| {
        let Some(leader) = c.slot_leader(TARGET) else { return false };
        c.core(leader).reader().runtime_meta(&channel).unwrap().is_some_and(|m| m.write_fence.is_none())
    });
    assert!(cleared, "the fence that came with the slot is cleared within 8 s");
}

#[test]
fn a_migration_whose_source_cannot_read_its_copy_for_a_while_reads_again_and_loses_nothing() {
    // The source leader's store fails the reads of the slot's copy: three in the copy phase (the
    // bounded export scans) and three in the marks phase (the reads of each marked key's value). Every
    // other read and every write of that store keeps working, so the node's raft groups and FSMs run on.
    let (mut cluster, mut load) = slow_copy_cluster(300, 500);
    load.run(&mut cluster, 150, 10);
    let source_leader = cluster.slot_leader(SOURCE).unwrap();
    let kv = cluster.nodes[&NodeId::new(source_leader)].kv.clone();
    let copy = MetaSpace::slot(SOURCE, the_slot()).kv_prefix();
    let report = |c: &mut Cluster| c.core(source_leader).status().slot_migrations.first().cloned();
    start(&mut cluster, 1);
    assert!(run_loaded(&mut cluster, &mut load, 20_000, |c| report(c).is_some_and(|r| r.phase == MigrationPhase::Copy)));
    let copied_before = report(&mut cluster).unwrap().keys_copied;
    kv.fail_under(FailOp::Scan, Keyspace::Meta, &copy, 0, 3);
    // The marks phase begins once the fence applied: from then on no write reaches the slot's copy, so a
    // failed get of it can only be the export's.
    let marks =
        run_loaded(&mut cluster, &mut load, 20_000, |c| report(c).is_some_and(|r| r.phase >= MigrationPhase::Marks));
    assert!(marks, "the export gets past the failed scans");
    let at_marks = report(&mut cluster).unwrap();
    assert_eq!(at_marks.read_failures, 3, "each failed scan is counted once: {at_marks:?}");
    assert!(at_marks.keys_copied > copied_before, "the copy went on from where it was");
    assert_eq!(at_marks.phase, MigrationPhase::Marks, "the marks phase takes several steps here");
    kv.fail_under(FailOp::Get, Keyspace::Meta, &copy, 0, 3);
    let failed_reads = std::cell::Cell::new(0);
    let done = run_loaded(&mut cluster, &mut load, 40_000, |c| {
        if let Some(r) = report(c) {
            failed_reads.set(r.read_failures);
        }
        migrated(c, 1)
    });
    assert!(done, "the migration completes");
    assert_eq!(failed_reads.get(), 6, "the three failed gets were counted too");
    assert_eq!(kv.injected_failures(), 6);
    for node in 1..=4u64 {
        assert!(!cluster.core(node).status().slot_storage_failed, "node {node} stopped its slot replicas");
    }
    load.write_all(&mut cluster, 10);
    load.run(&mut cluster, 100, 30);
    cluster.run_for(3_000);
    check_moved(&mut cluster, &load);
}
