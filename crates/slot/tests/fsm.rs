//! The slot FSM: every command and outcome, slot ownership, atomicity under a failpoint, exactly-once
//! replay, and the reads that see the result.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tidings_router::{hash_slot, HashToSlot};
use tidings_slot::command::{Command, DecodeError, MemberList, COMMAND_VERSION};
use tidings_slot::fsm::migration::seed_placements;
use tidings_slot::fsm::{FsmLimits, Outcome, Refusal, SlotFsm};
use tidings_slot::model::{
    ChannelFlags, ChannelInfo, CmdBinding, Device, Membership, MessageEvent, MigrationPhase, MigrationTask,
    PluginBinding, SwitchProof, Uid, User, PLUGIN_NAME_BYTES_MAX,
};
use tidings_slot::query::SlotReader;
use tidings_store::kv::{Direction, KeyRange, KvPair};
use tidings_store::{FailOp, Keyspace, Kv, KvBatch, MemoryKv, MetaStore, StoreResult};
use tidings_types::{ChannelId, ChannelRuntimeMeta, ChannelType, Epoch, GroupId, LeaderEpoch, MetaError, NodeId, Seq};

fn uid(s: &str) -> Uid {
    Uid::new(s).unwrap()
}

fn channel(s: &str) -> ChannelId {
    ChannelId::new(ChannelType::GROUP, s).unwrap()
}

/// One group owns every slot.
fn setup() -> (Arc<MemoryKv>, SlotFsm, SlotReader, HashToSlot) {
    let kv = Arc::new(MemoryKv::new());
    let store = MetaStore::new(kv.clone());
    let fsm = SlotFsm::new(
        GroupId::new(1),
        store.clone(),
        FsmLimits { members_per_command_max: 3, events_per_channel_max: 2, ..FsmLimits::default() },
    );
    let table = HashToSlot::even_split(1).unwrap();
    seed_placements(&store, &table).unwrap();
    (kv, fsm, SlotReader::new(store), table)
}

fn apply(fsm: &SlotFsm, table: &HashToSlot, first_index: u64, commands: &[Command]) -> Vec<Outcome> {
    let encoded: Vec<Vec<u8>> = commands.iter().map(Command::encode).collect();
    let entries: Vec<(u64, &[u8])> =
        encoded.iter().enumerate().map(|(i, e)| (first_index + i as u64, e.as_slice())).collect();
    fsm.apply(table, &entries).unwrap().into_iter().map(Option::unwrap).collect()
}

fn meta(ch: &ChannelId, version: u64, leader: u64, leader_epoch: u64) -> ChannelRuntimeMeta {
    ChannelRuntimeMeta {
        channel: ch.clone(),
        version,
        leader: NodeId::new(leader),
        replicas: vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)],
        isr: vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)],
        min_isr: 2,
        epoch: Epoch::new(1),
        leader_epoch: LeaderEpoch::new(leader_epoch),
        write_fence: None,
        retention_through: Seq::new(0),
    }
}

#[test]
fn users_channels_and_lists() {
    let (_, fsm, reader, table) = setup();
    let alice = User { uid: uid("alice"), name: "Alice".into(), banned: false };
    let room = ChannelInfo { channel: channel("room"), flags: ChannelFlags::default() };
    let outcomes = apply(
        &fsm,
        &table,
        1,
        &[
            Command::PutUser(alice.clone()),
            Command::CreateChannel(room.clone()),
            Command::CreateChannel(room.clone()),
            Command::UpdateChannelFlags { channel: channel("nope"), flags: ChannelFlags::default() },
            Command::AddMembers {
                channel: channel("room"),
                list: MemberList::Subscribers,
                uids: vec![uid("a"), uid("b"), uid("c")],
            },
            Command::AddMembers { channel: channel("room"), list: MemberList::Deny, uids: vec![uid("x"); 4] },
            Command::RemoveMembers { channel: channel("room"), list: MemberList::Subscribers, uids: vec![uid("b")] },
        ],
    );
    assert_eq!(outcomes[..4], [Outcome::Applied, Outcome::Applied, Outcome::AlreadyExists, Outcome::NotFound]);
    assert_eq!(outcomes[5], Outcome::Refused(Refusal::TooMany { count: 4, max: 3 }));
    assert_eq!(reader.user(&uid("alice")).unwrap(), Some(alice));
    assert_eq!(reader.channel(&channel("room")).unwrap(), Some(room));
    let page = reader.members(&channel("room"), MemberList::Subscribers, None, 1).unwrap();
    assert_eq!(page.items, vec![uid("a")]);
    let rest = reader.members(&channel("room"), MemberList::Subscribers, page.cursor.as_deref(), 10).unwrap();
    assert_eq!(rest.items, vec![uid("c")]);
    assert!(!reader.is_member(&channel("room"), MemberList::Deny, &uid("x")).unwrap());
    assert_eq!(fsm.applied_index().unwrap(), 7);
}

#[test]
fn memberships_are_user_owned_and_paged() {
    let (_, fsm, reader, table) = setup();
    let state = Membership {
        join_seq: Seq::new(3),
        read_seq: Seq::new(9),
        hidden: true,
        active: true,
        ..Membership::default()
    };
    let mut commands = Vec::new();
    for c in ["c1", "c2", "c3"] {
        commands.push(Command::PutMembership { uid: uid("bob"), channel: channel(c), membership: state });
    }
    apply(&fsm, &table, 1, &commands);
    assert_eq!(reader.membership(&uid("bob"), &channel("c2")).unwrap(), Some(state));
    let page = reader.memberships(&uid("bob"), None, 2).unwrap();
    assert_eq!(page.items.len(), 2);
    let rest = reader.memberships(&uid("bob"), page.cursor.as_deref(), 2).unwrap();
    assert_eq!(rest.items.iter().map(|(c, _)| c.id().to_owned()).collect::<Vec<_>>(), vec!["c3"]);
}

#[test]
fn runtime_meta_cas_and_switch_proofs() {
    let (_, fsm, reader, table) = setup();
    let ch = channel("room");
    let m1 = meta(&ch, 1, 1, 1);
    let mut isr_shrink = meta(&ch, 2, 1, 1);
    isr_shrink.isr = vec![NodeId::new(1), NodeId::new(2)];
    isr_shrink.epoch = Epoch::new(2);
    let outcomes = apply(
        &fsm,
        &table,
        1,
        &[
            Command::CreateRuntimeMeta(m1.clone()),
            Command::CreateRuntimeMeta(m1.clone()),
            Command::CasRuntimeMeta { expected_version: 7, meta: isr_shrink.clone(), proof: None },
            Command::CasRuntimeMeta { expected_version: 1, meta: isr_shrink.clone(), proof: None },
        ],
    );
    assert_eq!(
        outcomes,
        vec![Outcome::Applied, Outcome::AlreadyExists, Outcome::VersionMismatch { current: 1 }, Outcome::Applied]
    );
    // Leader switch: needs a proof with |ISR| - MinISR + 1 = 1 evidence, new leader most advanced.
    let mut switch = isr_shrink.clone();
    switch.version = 3;
    switch.leader = NodeId::new(2);
    switch.leader_epoch = LeaderEpoch::new(2);
    let le = LeaderEpoch::new;
    let weak = SwitchProof {
        task: 9,
        expected_leader_epoch: le(1),
        evidence: vec![(NodeId::new(2), le(1), Seq::new(5)), (NodeId::new(1), le(1), Seq::new(6))],
    };
    let good =
        SwitchProof { task: 9, expected_leader_epoch: le(1), evidence: vec![(NodeId::new(2), le(1), Seq::new(6))] };
    let outcomes = apply(
        &fsm,
        &table,
        5,
        &[
            Command::CasRuntimeMeta { expected_version: 2, meta: switch.clone(), proof: None },
            Command::CasRuntimeMeta { expected_version: 2, meta: switch.clone(), proof: Some(weak) },
            Command::CasRuntimeMeta { expected_version: 2, meta: switch.clone(), proof: Some(good) },
        ],
    );
    assert!(matches!(outcomes[0], Outcome::Refused(Refusal::BadProof(_))));
    assert!(matches!(outcomes[1], Outcome::Refused(Refusal::BadProof(_))));
    assert_eq!(outcomes[2], Outcome::Applied);
    assert_eq!(reader.runtime_meta(&ch).unwrap(), Some(switch));
    // An invalid successor (leader epoch back) is refused, deterministically.
    let mut back = meta(&ch, 4, 2, 1);
    back.isr = vec![NodeId::new(1), NodeId::new(2)];
    back.epoch = Epoch::new(2);
    let outcomes = apply(&fsm, &table, 8, &[Command::CasRuntimeMeta { expected_version: 3, meta: back, proof: None }]);
    assert!(matches!(outcomes[0], Outcome::Refused(Refusal::InvalidMeta(_))));
}

#[test]
fn commands_for_slots_of_other_groups_are_refused() {
    let kv = Arc::new(MemoryKv::new());
    let store = MetaStore::new(kv);
    let table = HashToSlot::even_split(2).unwrap();
    seed_placements(&store, &table).unwrap();
    let user = User { uid: uid("carol"), name: String::new(), banned: false };
    let owner = table.group_of(hash_slot(b"carol"));
    let other = if owner == GroupId::new(1) { GroupId::new(2) } else { GroupId::new(1) };
    let fsm = SlotFsm::new(other, store.clone(), FsmLimits::default());
    let outcomes = apply(&fsm, &table, 1, &[Command::PutUser(user)]);
    assert_eq!(outcomes, vec![Outcome::Refused(Refusal::WrongSlot { slot: hash_slot(b"carol"), owner })]);
    assert_eq!(SlotReader::new(store).user(&uid("carol")).unwrap(), None);
    assert_eq!(fsm.applied_index().unwrap(), 1, "a refused command still advances the applied index");
}

#[test]
fn a_batch_is_applied_whole_or_not_at_all_and_replay_applies_once() {
    let (kv, fsm, reader, table) = setup();
    let commands = [
        Command::PutUser(User { uid: uid("u1"), name: "one".into(), banned: false }),
        Command::PutUser(User { uid: uid("u2"), name: "two".into(), banned: false }),
    ];
    kv.fail(FailOp::Apply, 0, 1);
    let encoded: Vec<Vec<u8>> = commands.iter().map(Command::encode).collect();
    let entries: Vec<(u64, &[u8])> = vec![(1, &encoded[0]), (2, &encoded[1])];
    assert!(fsm.apply(&table, &entries).is_err());
    assert_eq!(reader.user(&uid("u1")).unwrap(), None);
    assert_eq!(fsm.applied_index().unwrap(), 0);
    assert!(fsm.apply(&table, &entries).unwrap().iter().all(Option::is_some));
    // Replay after a restart: entries at or below the applied index are skipped.
    let events = [Command::AppendMessageEvent {
        channel: channel("r"),
        event: MessageEvent { seq: Seq::new(1), sender: uid("u1"), summary: "hi".into() },
    }];
    apply(&fsm, &table, 3, &events);
    let again = fsm.apply(&table, &[(3, &events[0].encode())]).unwrap();
    assert_eq!(again, vec![None]);
    assert_eq!(reader.events(&channel("r"), 10).unwrap().len(), 1);
}

#[test]
fn event_projection_is_bounded() {
    let (_, fsm, reader, table) = setup();
    let event = |seq: u64| Command::AppendMessageEvent {
        channel: channel("r"),
        event: MessageEvent { seq: Seq::new(seq), sender: uid("u"), summary: format!("m{seq}") },
    };
    apply(&fsm, &table, 1, &[event(1), event(2), event(3)]);
    apply(&fsm, &table, 4, &[event(4)]);
    let kept: Vec<u64> = reader.events(&channel("r"), 10).unwrap().iter().map(|e| e.seq.get()).collect();
    assert_eq!(kept, vec![3, 4]);
}

/// The records stored by a user's slot or a channel's, written, read back through the reader (which
/// finds them only in the slot their owner hashes to) and removed again.
#[test]
fn every_record_kind_is_read_back_from_its_owner_s_slot_and_removed() {
    let (_, fsm, reader, table) = setup();
    let (bob, cmd, room) = (uid("bob"), channel("bob-cmd"), channel("room"));
    // A record kept in the wrong one of these slots would read back as absent.
    assert_ne!(hash_slot(bob.as_str().as_bytes()), hash_slot(cmd.route_key()));
    assert_ne!(hash_slot(bob.as_str().as_bytes()), hash_slot(room.route_key()));
    let phone = Device { uid: bob.clone(), device_flag: 1, token: "t1".into(), level: 2 };
    let binding = CmdBinding { ack_seq: Seq::new(7) };
    let plugin = PluginBinding { uid: bob.clone(), plugin: "bot".into() };
    let task = MigrationTask { id: 9, channel: room.clone(), phase: MigrationPhase::Fenced, target_leader: None };
    let flags = ChannelFlags { send_ban: true, large: true, ..ChannelFlags::default() };
    let outcomes = apply(
        &fsm,
        &table,
        1,
        &[
            Command::PutDevice(phone.clone()),
            Command::AddSystemUid(bob.clone()),
            Command::PutCmdBinding { uid: bob.clone(), channel: cmd.clone(), binding },
            Command::PutPluginBinding(plugin.clone()),
            Command::CreateChannel(ChannelInfo { channel: room.clone(), flags: ChannelFlags::default() }),
            Command::UpdateChannelFlags { channel: room.clone(), flags },
            Command::PutMigrationTask(task.clone()),
            Command::PutMembership { uid: bob.clone(), channel: room.clone(), membership: Membership::default() },
        ],
    );
    assert!(outcomes.iter().all(|o| *o == Outcome::Applied), "{outcomes:?}");
    assert_eq!(reader.device(&bob, 1).unwrap(), Some(phone));
    assert_eq!(reader.device(&bob, 2).unwrap(), None);
    assert!(reader.is_system_uid(&bob).unwrap());
    assert!(!reader.is_system_uid(&uid("carol")).unwrap());
    assert_eq!(reader.cmd_binding(&bob, &cmd).unwrap(), Some(binding));
    assert_eq!(reader.plugin(&bob, "bot").unwrap(), Some(plugin));
    assert_eq!(reader.channel(&room).unwrap(), Some(ChannelInfo { channel: room.clone(), flags }));
    assert_eq!(reader.task(&room, 9).unwrap(), Some(task));
    assert_eq!(reader.membership(&bob, &room).unwrap(), Some(Membership::default()));

    let outcomes = apply(
        &fsm,
        &table,
        9,
        &[
            Command::RemoveDevice { uid: bob.clone(), device_flag: 1 },
            Command::RemoveSystemUid(bob.clone()),
            Command::RemovePluginBinding { uid: bob.clone(), plugin: "bot".into() },
            Command::RemoveMigrationTask { channel: room.clone(), id: 9 },
            Command::RemoveMembership { uid: bob.clone(), channel: room.clone() },
        ],
    );
    assert!(outcomes.iter().all(|o| *o == Outcome::Applied), "{outcomes:?}");
    assert_eq!(reader.device(&bob, 1).unwrap(), None);
    assert!(!reader.is_system_uid(&bob).unwrap());
    assert_eq!(reader.plugin(&bob, "bot").unwrap(), None);
    assert_eq!(reader.task(&room, 9).unwrap(), None);
    assert_eq!(reader.membership(&bob, &room).unwrap(), None);
    // What the removals did not name stays.
    assert_eq!(reader.cmd_binding(&bob, &cmd).unwrap(), Some(binding));
    assert_eq!(fsm.applied_index().unwrap(), 13);
}

/// Commands whose content breaks a rule are refused with the rule, and change nothing.
#[test]
fn an_invalid_runtime_meta_and_an_oversized_event_summary_are_refused() {
    let (_, fsm, reader, table) = setup();
    let room = channel("room");
    let mut leaderless = meta(&room, 1, 4, 1);
    leaderless.isr.truncate(2);
    let long = "x".repeat(FsmLimits::default().event_summary_bytes_max + 1);
    let outcomes = apply(
        &fsm,
        &table,
        1,
        &[
            Command::CreateRuntimeMeta(leaderless),
            Command::AppendMessageEvent {
                channel: room.clone(),
                event: MessageEvent { seq: Seq::new(1), sender: uid("u"), summary: long.clone() },
            },
        ],
    );
    assert_eq!(
        outcomes,
        vec![
            Outcome::Refused(Refusal::InvalidMeta(MetaError::LeaderNotInIsr(NodeId::new(4)))),
            Outcome::Refused(Refusal::SummaryTooLarge { len: long.len(), max: long.len() - 1 }),
        ]
    );
    assert_eq!(reader.runtime_meta(&room).unwrap(), None);
    assert!(reader.events(&room, 10).unwrap().is_empty());
    // A refusal is an outcome of the entry, which counts as applied like any other.
    assert_eq!(fsm.applied_index().unwrap(), 2);
}

/// A plugin name is a length-prefixed segment of its binding's key: a longer one is refused, never cut
/// short to the name of another binding.
#[test]
fn plugin_names_longer_than_a_key_segment_are_refused_and_touch_no_other_binding() {
    let (_, fsm, reader, table) = setup();
    let bob = uid("bob");
    let longest = "p".repeat(PLUGIN_NAME_BYTES_MAX);
    let too_long = format!("{longest}x");
    let kept = PluginBinding { uid: bob.clone(), plugin: longest.clone() };
    let outcomes = apply(
        &fsm,
        &table,
        1,
        &[
            Command::PutPluginBinding(kept.clone()),
            Command::PutPluginBinding(PluginBinding { uid: bob.clone(), plugin: too_long.clone() }),
            Command::RemovePluginBinding { uid: bob.clone(), plugin: too_long.clone() },
        ],
    );
    let refused = Outcome::Refused(Refusal::PluginNameTooLong { len: too_long.len(), max: PLUGIN_NAME_BYTES_MAX });
    assert_eq!(outcomes, vec![Outcome::Applied, refused.clone(), refused]);
    assert_eq!(reader.plugin(&bob, &longest).unwrap(), Some(kept), "the refused removal left it");
    assert_eq!(reader.plugin(&bob, &too_long).unwrap(), None, "no binding has a longer name");
}

#[test]
fn garbage_and_newer_commands_are_refused_with_types() {
    let (_, fsm, _, table) = setup();
    let mut newer = postcard::to_allocvec(&(COMMAND_VERSION + 1, 0u8)).unwrap();
    newer.extend_from_slice(&[1, 2, 3]);
    let outcomes = fsm.apply(&table, &[(1, &[0xff, 0xff, 0xff][..]), (2, &newer[..])]).unwrap();
    assert_eq!(outcomes[0], Some(Outcome::Refused(Refusal::Decode(DecodeError::Malformed))));
    assert_eq!(
        outcomes[1],
        Some(Outcome::Refused(Refusal::Decode(DecodeError::UnsupportedVersion {
            got: COMMAND_VERSION + 1,
            max: COMMAND_VERSION
        })))
    );
}

/// Applies `command` under the membership `conf` at `index`.
fn apply_in_conf(
    fsm: &SlotFsm,
    table: &HashToSlot,
    conf: &tidings_slot::fsm::GroupConf,
    index: u64,
    command: &Command,
) -> Outcome {
    let encoded = command.encode();
    let applied = fsm.apply_in(table, conf, false, &[(index, encoded.as_slice())]).unwrap();
    applied.outcomes.into_iter().next().flatten().unwrap()
}

#[test]
fn group_intent_changes_are_checked_against_the_intent_and_the_membership_in_force() {
    use tidings_slot::fsm::{GroupChangeError, GroupConf};
    use tidings_types::ConfigEpoch;
    let (_, fsm, reader, table) = setup();
    let group = GroupId::new(1);
    let n = NodeId::new;
    let conf = |voters: &[u64], epoch: u64, joint: bool| GroupConf {
        voters: voters.iter().copied().map(n).collect(),
        learners: Vec::new(),
        joint,
        config_epoch: ConfigEpoch::new(epoch),
    };
    let refused = |error| Outcome::Refused(Refusal::GroupChange(error));
    let mv = |from, to| Command::MoveGroupReplica { group, from: n(from), to: n(to) };
    let commit = Command::CommitGroupConfig { group };
    let abort = Command::AbortGroupMove { group };
    let in_force = conf(&[1, 2, 3], 0, false);

    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 1, &commit), refused(GroupChangeError::NothingToCommit));
    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 2, &abort), refused(GroupChangeError::NoMoveInProgress));
    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 3, &mv(9, 4)), refused(GroupChangeError::NotAVoter(n(9))));
    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 4, &mv(1, 2)), refused(GroupChangeError::AlreadyAVoter(n(2))));
    // A group without an intent starts from its voters in force.
    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 5, &mv(3, 4)), Outcome::Applied);
    let intent = reader.group_intent(group).unwrap().unwrap();
    assert_eq!(intent.desired_peers, vec![n(1), n(2), n(3)]);
    assert_eq!(intent.target_peers, Some(vec![n(1), n(2), n(4)]));
    let target = vec![n(1), n(2), n(4)];
    assert_eq!(
        apply_in_conf(&fsm, &table, &in_force, 6, &mv(2, 5)),
        refused(GroupChangeError::MoveInProgress { target: target.clone() })
    );
    // The commit checks the membership in force at its own entry: not joint, voters = target.
    let joint = conf(&[1, 2, 4], 9, true);
    assert!(matches!(
        apply_in_conf(&fsm, &table, &joint, 7, &commit),
        Outcome::Refused(Refusal::GroupChange(GroupChangeError::ConfigMismatch { joint: true, .. }))
    ));
    assert_eq!(apply_in_conf(&fsm, &table, &conf(&[1, 2, 4], 11, false), 12, &commit), Outcome::Applied);
    let intent = reader.group_intent(group).unwrap().unwrap();
    assert_eq!(
        (intent.desired_peers.clone(), intent.config_epoch, intent.target_peers.clone()),
        (target, ConfigEpoch::new(11), None)
    );
    // Drained nodes cannot receive a replica; an abort retargets the move to the assignment.
    let drain = Command::DrainNode { group, node: n(5), drain: true };
    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 13, &drain), Outcome::Applied);
    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 14, &mv(4, 5)), refused(GroupChangeError::TargetDraining(n(5))));
    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 15, &mv(4, 3)), Outcome::Applied);
    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 16, &abort), Outcome::Applied);
    let intent = reader.group_intent(group).unwrap().unwrap();
    assert_eq!(intent.target_peers.as_deref(), Some(&intent.desired_peers[..]));
    assert_eq!(intent.draining, vec![n(5)]);
    assert_eq!(apply_in_conf(&fsm, &table, &in_force, 17, &abort), refused(GroupChangeError::NoMoveInProgress));
    // A command about another group is refused where it lands.
    let other = Command::AbortGroupMove { group: GroupId::new(2) };
    assert_eq!(
        apply_in_conf(&fsm, &table, &in_force, 18, &other),
        Outcome::Refused(Refusal::WrongGroup { group: GroupId::new(2) })
    );
}

/// Applies one command at the next index of `fsm` and returns its outcome.
fn step(fsm: &SlotFsm, table: &HashToSlot, command: Command) -> Outcome {
    let next = fsm.applied_index().unwrap() + 1;
    apply(fsm, table, next, &[command]).remove(0)
}

/// Two slot groups (1 and 2, an even split of the slots) with their FSMs on one node's store.
struct TwoGroups {
    store: MetaStore,
    table: HashToSlot,
    a: GroupId,
    b: GroupId,
    source: SlotFsm,
    target: SlotFsm,
    reader: SlotReader,
}

fn two_groups_on_one_node() -> TwoGroups {
    two_groups_over(Arc::new(MemoryKv::new()))
}

/// [`two_groups_on_one_node`] over `kv`. The reader has a store handle of its own, as a node's reactors
/// do: what it caches must follow writes made through the FSMs' handle.
fn two_groups_over(kv: Arc<dyn Kv>) -> TwoGroups {
    let store = MetaStore::new(kv.clone());
    let table = HashToSlot::even_split(2).unwrap();
    seed_placements(&store, &table).unwrap();
    let (a, b) = (GroupId::new(1), GroupId::new(2));
    let source = SlotFsm::new(a, store.clone(), FsmLimits::default());
    let target = SlotFsm::new(b, store.clone(), FsmLimits::default());
    let reader = SlotReader::new(MetaStore::new(kv));
    TwoGroups { store, table, a, b, source, target, reader }
}

/// A memory backend that counts reads of placements.
#[derive(Default)]
struct PlacementReads {
    inner: MemoryKv,
    reads: AtomicUsize,
}

impl Kv for PlacementReads {
    fn get_sealed(&self, keyspace: Keyspace, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        if keyspace == Keyspace::Placement {
            self.reads.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.get_sealed(keyspace, key)
    }

    fn scan_sealed(
        &self,
        keyspace: Keyspace,
        range: &KeyRange,
        direction: Direction,
        limit: usize,
    ) -> StoreResult<Vec<KvPair>> {
        self.inner.scan_sealed(keyspace, range, direction, limit)
    }

    fn apply(&self, batch: KvBatch) -> StoreResult<()> {
        self.inner.apply(batch)
    }

    fn sync(&self) -> StoreResult<()> {
        self.inner.sync()
    }

    fn cache_epoch(&self) -> &AtomicU64 {
        self.inner.cache_epoch()
    }
}

#[test]
fn a_reader_looks_a_slot_s_placement_up_once_until_a_write_changes_routes() {
    use tidings_slot::model::SlotMigrationStep as Step;
    let kv = Arc::new(PlacementReads::default());
    let TwoGroups { table, a, b, source, reader, .. } = two_groups_over(kv.clone());
    let user = (0..)
        .map(|i| uid(&format!("user-{i}")))
        .find(|u| table.group_of(hash_slot(u.as_str().as_bytes())) == a)
        .unwrap();
    let slot = hash_slot(user.as_str().as_bytes());
    let put = Command::PutUser(User { uid: user.clone(), name: "one".into(), banned: false });
    assert_eq!(step(&source, &table, put), Outcome::Applied);
    let reads = || kv.reads.load(Ordering::SeqCst);

    let before = reads();
    for _ in 0..3 {
        assert!(reader.user(&user).unwrap().is_some());
        assert_eq!(reader.owner_copy(slot).unwrap(), Some(a));
    }
    assert_eq!(reads() - before, 1, "one placement read for six reads of the slot");

    // Writes to keys in slots' copies route nothing: the cached placement still serves.
    let renamed = Command::PutUser(User { uid: user.clone(), name: "two".into(), banned: false });
    assert_eq!(step(&source, &table, renamed), Outcome::Applied);
    assert_eq!(reader.user(&user).unwrap().unwrap().name, "two", "the key itself is always read");
    assert_eq!(reads() - before, 1);

    // A migration step writes the group's slot records: the next read looks the placement up again.
    let export = Command::MigrateSlot { group: a, slot, step: Step::Export { to: b } };
    assert_eq!(step(&source, &table, export), Outcome::Applied);
    assert_eq!(reader.owner_copy(slot).unwrap(), Some(a), "exporting: the source still serves");
    assert_eq!(reads() - before, 2);
}

#[test]
fn a_hash_slot_migrates_between_two_groups_on_one_node_without_touching_either_copy() {
    use tidings_slot::fsm::migration::SlotMigrationError;
    use tidings_slot::model::{SlotMigrationStep as Step, SlotState};
    let TwoGroups { store, table, a, b, source, target, reader } = two_groups_on_one_node();
    // Two users of one slot of group 1, and one more written during the copy.
    let users: Vec<Uid> = (0..2000)
        .map(|i| uid(&format!("user-{i}")))
        .filter(|u| table.group_of(hash_slot(u.as_str().as_bytes())) == a)
        .collect();
    let slot = hash_slot(users[0].as_str().as_bytes());
    let in_slot: Vec<Uid> = users.into_iter().filter(|u| hash_slot(u.as_str().as_bytes()) == slot).take(3).collect();
    let put = |u: &Uid, name: &str| Command::PutUser(User { uid: u.clone(), name: name.into(), banned: false });
    let migrate = |group, step| Command::MigrateSlot { group, slot, step };
    assert_eq!(step(&source, &table, put(&in_slot[0], "zero")), Outcome::Applied);
    assert_eq!(step(&source, &table, put(&in_slot[1], "one")), Outcome::Applied);

    assert_eq!(step(&source, &table, migrate(a, Step::Export { to: b })), Outcome::Applied);
    assert_eq!(
        step(&target, &table, migrate(b, Step::BeginImport { from: a, epoch: 1, attempt: 7 })),
        Outcome::Applied
    );
    // The copy, made from the source's copy of the slot.
    let copy = reader.export_slot(a, slot, None, usize::MAX).unwrap();
    assert_eq!(copy.items.len(), 2);
    let entries = copy.items.into_iter().map(|(k, v)| (k, Some(v))).collect();
    let chunk = Step::ImportChunk { from: a, epoch: 1, attempt: 7, entries };
    assert_eq!(step(&target, &table, migrate(b, chunk)), Outcome::Applied);
    // Writes go on at the source meanwhile, and are marked; the target refuses them.
    assert_eq!(step(&source, &table, put(&in_slot[1], "one, renamed")), Outcome::Applied);
    assert_eq!(step(&source, &table, put(&in_slot[2], "two")), Outcome::Applied);
    assert_eq!(
        step(&target, &table, put(&in_slot[2], "elsewhere")),
        Outcome::Refused(Refusal::WrongSlot { slot, owner: a })
    );
    let marks = reader.slot_marks(a, slot, None, 100).unwrap().items;
    assert_eq!(marks.len(), 2, "both keys written while exporting are marked");
    // Page by page, with the page's cursor or with its last key alike, each mark comes once.
    let first = reader.slot_marks(a, slot, None, 1).unwrap();
    assert_eq!(first.cursor.as_deref(), Some(marks[0].as_slice()), "a page's cursor is its last key");
    for after in [first.cursor.clone(), Some(first.items[0].clone())] {
        let next = reader.slot_marks(a, slot, after.as_deref(), 1).unwrap();
        assert_eq!(next.items, vec![marks[1].clone()], "the next page starts after the first");
    }
    // Fence: writes refused (retryable); reads still served by the source copy.
    assert_eq!(step(&source, &table, migrate(a, Step::Fence { to: b, epoch: 1 })), Outcome::Applied);
    assert_eq!(step(&source, &table, put(&in_slot[0], "late")), Outcome::Refused(Refusal::SlotFenced { slot, to: b }));
    assert_eq!(
        step(&source, &table, migrate(a, Step::AbortExport)),
        Outcome::Refused(Refusal::Migration(SlotMigrationError::Fenced))
    );
    assert_eq!(reader.user(&in_slot[2]).unwrap().unwrap().name, "two");
    // The marked keys, then the commit: the node now reads the target's copy.
    let entries = marks.iter().map(|k| (k.clone(), reader.raw_in(a, slot, k).unwrap())).collect();
    let delta = Step::ImportChunk { from: a, epoch: 1, attempt: 7, entries };
    assert_eq!(step(&target, &table, migrate(b, delta)), Outcome::Applied);
    let stale = Step::ImportChunk { from: a, epoch: 1, attempt: 6, entries: vec![(b"x".to_vec(), None)] };
    assert_eq!(
        step(&target, &table, migrate(b, stale)),
        Outcome::Refused(Refusal::Migration(SlotMigrationError::StaleAttempt { offered: 6, current: 7 }))
    );
    assert_eq!(
        step(&target, &table, migrate(b, Step::CommitImport { from: a, epoch: 1, attempt: 7 })),
        Outcome::Applied
    );
    assert_eq!(store.placement(slot).unwrap().map(|p| (p.group, p.epoch)), Some((b, 1)));
    assert_eq!(step(&target, &table, put(&in_slot[0], "zero at b")), Outcome::Applied);
    // The source finishes: its copy goes, the target's stays; the source answers with the new owner.
    assert_eq!(step(&source, &table, migrate(a, Step::Finish { to: b, epoch: 1 })), Outcome::Applied);
    assert!(reader.export_slot(a, slot, None, usize::MAX).unwrap().items.is_empty());
    assert!(reader.slot_marks(a, slot, None, 10).unwrap().items.is_empty());
    assert_eq!(
        step(&source, &table, put(&in_slot[0], "stale route")),
        Outcome::Refused(Refusal::SlotMoved { slot, owner: b, epoch: 1 })
    );
    let names: Vec<String> = in_slot.iter().map(|u| reader.user(u).unwrap().unwrap().name).collect();
    assert_eq!(names, ["zero at b", "one, renamed", "two"]);
    assert_eq!(reader.slot_record(a, slot).unwrap().map(|r| r.state), Some(SlotState::Gone { to: b }));
    assert_eq!(reader.slot_record(b, slot).unwrap().map(|r| (r.epoch, r.state)), Some((1, SlotState::Owned)));
}

#[test]
fn a_copy_is_the_owner_copy_only_once_this_node_s_replica_applied_its_import() {
    use tidings_slot::model::SlotMigrationStep as Step;
    let TwoGroups { store, table, a, b, source, target, reader } = two_groups_on_one_node();
    let banned = (0..)
        .map(|i| uid(&format!("user-{i}")))
        .find(|u| table.group_of(hash_slot(u.as_str().as_bytes())) == a)
        .unwrap();
    let slot = hash_slot(banned.as_str().as_bytes());
    let migrate = |group, step| Command::MigrateSlot { group, slot, step };
    let user = Command::PutUser(User { uid: banned.clone(), name: "banned".into(), banned: true });
    assert_eq!(step(&source, &table, user), Outcome::Applied);
    assert_eq!(reader.owner_copy(slot).unwrap(), Some(a), "never migrated: the genesis owner's copy");

    assert_eq!(step(&source, &table, migrate(a, Step::Export { to: b })), Outcome::Applied);
    assert_eq!(
        step(&target, &table, migrate(b, Step::BeginImport { from: a, epoch: 1, attempt: 1 })),
        Outcome::Applied
    );
    assert_eq!(step(&source, &table, migrate(a, Step::Fence { to: b, epoch: 1 })), Outcome::Applied);
    assert_eq!(reader.owner_copy(slot).unwrap(), Some(a), "exporting and fenced: the source still serves");
    // The group's leaders committed the import and the finish; on this node the source's replica applies
    // the finish first, before the target's replica applied the copy or its commit.
    assert_eq!(step(&source, &table, migrate(a, Step::Finish { to: b, epoch: 1 })), Outcome::Applied);
    assert_eq!(store.placement(slot).unwrap().map(|p| p.group), Some(b));
    assert!(reader.user(&banned).unwrap().is_none(), "the placed copy lacks the user yet");
    assert_eq!(reader.owner_copy(slot).unwrap(), None, "a copy still importing here must not be trusted");

    assert_eq!(
        step(&target, &table, migrate(b, Step::CommitImport { from: a, epoch: 1, attempt: 1 })),
        Outcome::Applied
    );
    assert_eq!(reader.owner_copy(slot).unwrap(), Some(b));
}

/// `SlotReader::in_copy` reads one group's copy of a hash slot whatever this node's placement names: a
/// copy being imported before its commit, and nothing where the group holds no copy.
#[test]
fn a_reader_in_a_copy_reads_that_groups_copy_whatever_the_placement_names() {
    use tidings_slot::model::SlotMigrationStep as Step;
    let TwoGroups { table, a, b, source, target, reader, .. } = two_groups_on_one_node();
    let owner = (0..2000)
        .map(|i| uid(&format!("user-{i}")))
        .find(|u| table.group_of(hash_slot(u.as_str().as_bytes())) == a)
        .unwrap();
    let slot = hash_slot(owner.as_str().as_bytes());
    let device = Device { uid: owner.clone(), device_flag: 1, token: "t".into(), level: 0 };
    assert_eq!(step(&source, &table, Command::PutDevice(device.clone())), Outcome::Applied);
    assert_eq!(reader.in_copy(a).device(&owner, 1).unwrap(), Some(device.clone()));
    assert_eq!(reader.in_copy(b).device(&owner, 1).unwrap(), None, "group 2 holds no copy of the slot");

    // Group 2 takes a copy; the node's placement still names group 1.
    let migrate = |group, step| Command::MigrateSlot { group, slot, step };
    assert_eq!(step(&source, &table, migrate(a, Step::Export { to: b })), Outcome::Applied);
    let begin = Step::BeginImport { from: a, epoch: 1, attempt: 1 };
    assert_eq!(step(&target, &table, migrate(b, begin)), Outcome::Applied);
    let entries = reader.export_slot(a, slot, None, usize::MAX).unwrap().items;
    let chunk = Step::ImportChunk {
        from: a,
        epoch: 1,
        attempt: 1,
        entries: entries.into_iter().map(|(k, v)| (k, Some(v))).collect(),
    };
    assert_eq!(step(&target, &table, migrate(b, chunk)), Outcome::Applied);
    let remove = Command::RemoveDevice { uid: owner.clone(), device_flag: 1 };
    assert_eq!(step(&source, &table, remove), Outcome::Applied);

    assert_eq!(reader.device(&owner, 1).unwrap(), None, "the placement's copy took the removal");
    assert_eq!(reader.in_copy(a).device(&owner, 1).unwrap(), None);
    assert_eq!(reader.in_copy(b).device(&owner, 1).unwrap(), Some(device), "the import's copy has not yet");
}
