//! Checks raft messages from the wire before raft-rs sees them. raft-rs trusts its peers: a message a
//! correct peer never sends (a heartbeat committing beyond the follower's log, entries out of order that
//! would contradict committed ones) makes it abort the process. Such a message is dropped here and
//! counted instead.

use raft::eraftpb::{Message, MessageType};
use raft::{RawNode, Storage};

/// `true` if raft-rs may step `message`, received over the wire from node `from` by node `me`.
pub(crate) fn admissible<S: Storage>(raw: &RawNode<S>, from: u64, me: u64, message: &Message) -> bool {
    // The raft header must name the transport's sender and this node.
    if message.from != from || message.to != me {
        return false;
    }
    let log = &raw.raft.raft_log;
    match message.get_msg_type() {
        // raft-rs commits `commit` at once: a correct leader never sends more than the follower holds.
        MessageType::MsgHeartbeat => message.commit <= log.last_index(),
        MessageType::MsgAppend => {
            // raft-rs panics when an entry conflicts with a committed one. Contiguous entries after
            // `index` rule that out: when `index` is below the follower's commit, raft-rs answers with
            // its commit without reading the entries, and otherwise every entry lies past the commit.
            // (Those entries are not checked against the log either: the follower may have compacted
            // them, and refusing them left a correct leader's probe unanswered for good.)
            let entries = message.get_entries();
            let contiguous = entries.iter().enumerate().all(|(i, e)| e.index == message.index + 1 + i as u64);
            let terms_ok = entries.iter().all(|e| e.term <= message.term && e.term >= message.log_term);
            contiguous && terms_ok
        }
        // A follower cannot have matched beyond the leader's log.
        MessageType::MsgAppendResponse => message.reject || message.index <= log.last_index(),
        // raft-rs forwards these to the leader when it is not one itself, and aborts if the forwarded
        // message carries a term it did not set. This driver forwards proposals its own way, so on the
        // wire they are only ever for the leader; proposals and read requests travel without a term.
        MessageType::MsgPropose | MessageType::MsgReadIndex => {
            raw.raft.state == raft::StateRole::Leader && message.term == 0
        }
        MessageType::MsgTransferLeader => raw.raft.state == raft::StateRole::Leader,
        _ => true,
    }
}

/// `true` for the message types that answer a request of the receiver. Their sender took the receiver's
/// known configuration epoch from that request (see `SlotBody::known_epoch`), so an answer naming an
/// older one comes from a replica that never saw the request: one destroyed since, its answer late.
pub(crate) fn is_answer(kind: MessageType) -> bool {
    matches!(
        kind,
        MessageType::MsgAppendResponse
            | MessageType::MsgHeartbeatResponse
            | MessageType::MsgRequestVoteResponse
            | MessageType::MsgRequestPreVoteResponse
            | MessageType::MsgReadIndexResp
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::eraftpb::{ConfState, Entry, Snapshot};
    use raft::storage::MemStorage;

    /// A follower (node 2 of 1..=3) whose log holds entries 41..=47 of term 2, all committed, the rest
    /// compacted into a snapshot at 40.
    fn compacted_follower() -> RawNode<MemStorage> {
        let storage = MemStorage::new_with_conf_state(ConfState::from((vec![1, 2, 3], vec![])));
        let mut snapshot = Snapshot::default();
        snapshot.mut_metadata().index = 40;
        snapshot.mut_metadata().term = 2;
        snapshot.mut_metadata().set_conf_state(ConfState::from((vec![1, 2, 3], vec![])));
        let mut core = storage.wl();
        core.apply_snapshot(snapshot).expect("snapshot applies");
        let entries: Vec<Entry> = (41..=47).map(|index| entry(index, 2)).collect();
        core.append(&entries).expect("entries append");
        core.mut_hard_state().commit = 47;
        core.mut_hard_state().term = 2;
        drop(core);
        let config = raft::Config { id: 2, applied: 47, ..raft::Config::default() };
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        RawNode::new(&config, storage, &logger).expect("raw node")
    }

    fn entry(index: u64, term: u64) -> Entry {
        Entry { index, term, ..Entry::default() }
    }

    fn append(index: u64, log_term: u64, entries: Vec<Entry>) -> Message {
        let mut message = Message::default();
        message.set_msg_type(MessageType::MsgAppend);
        (message.from, message.to, message.term, message.index, message.log_term) = (1, 2, 2, index, log_term);
        message.set_entries(entries.into());
        message
    }

    #[test]
    fn a_leaders_probe_below_the_followers_compacted_commit_is_stepped_and_answered() {
        let mut follower = compacted_follower();
        // The leader last heard the follower at 30 and sends from there: entries the follower compacted.
        let probe = append(30, 2, (31..=47).map(|index| entry(index, 2)).collect());
        assert!(admissible(&follower, 1, 2, &probe), "a correct leader's probe is refused");
        follower.step(probe).expect("raft-rs steps it");
        let ready = follower.ready();
        let answer = ready.messages().iter().chain(ready.persisted_messages()).find(|m| m.to == 1).cloned();
        let answer = answer.expect("the follower answers the leader");
        assert_eq!((answer.get_msg_type(), answer.index), (MessageType::MsgAppendResponse, 47));
    }

    #[test]
    fn entries_out_of_order_or_of_impossible_terms_are_refused() {
        let follower = compacted_follower();
        // Entries that do not follow `index`: raft-rs would compare them with committed ones.
        assert!(!admissible(&follower, 1, 2, &append(47, 2, vec![entry(45, 3)])));
        // An entry of a term after the message's own.
        assert!(!admissible(&follower, 1, 2, &append(47, 2, vec![entry(48, 3)])));
        // Sent by another node than the transport's sender.
        assert!(!admissible(&follower, 3, 2, &append(47, 2, vec![entry(48, 2)])));
        assert!(admissible(&follower, 1, 2, &append(47, 2, vec![entry(48, 2)])));
    }
}
