//! Checks raft messages from the wire before raft-rs sees them. raft-rs trusts its peers: a message a
//! correct peer never sends (a heartbeat committing beyond the follower's log, entries that contradict
//! committed ones) makes it abort the process. Such a message is dropped here and counted instead.

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
            let entries = message.get_entries();
            let contiguous = entries.iter().enumerate().all(|(i, e)| e.index == message.index + 1 + i as u64);
            let terms_ok = entries.iter().all(|e| e.term <= message.term && e.term >= message.log_term);
            // An entry at a committed index must be the committed one, or raft-rs panics on the conflict.
            let no_committed_conflict = entries
                .iter()
                .filter(|e| e.index <= log.committed)
                .all(|e| log.term(e.index).is_ok_and(|t| t == e.term));
            contiguous && terms_ok && no_committed_conflict
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
