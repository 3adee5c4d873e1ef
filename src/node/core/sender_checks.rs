//! `append_from`'s sender checks that a channel shard could not make from this node's slot replicas:
//! the two answers (is the user banned? is it on the channel's deny list?) come from local replicas
//! where this node has them and from other nodes where it does not (`remote_reads`). The append waits
//! here, bounded in number, until both are known; then it goes on to its channel's shard or fails typed.

use crate::node::error::NodeError;
use std::collections::BTreeMap;
use tidings_channel::machine::AppendRecord;
use tidings_slot::model::Uid;
use tidings_types::ChannelId;

use super::ApiId;

/// Sender checks waiting for answers, per node. Beyond it `append_from` fails `Overloaded`.
pub(super) const SENDER_CHECKS_MAX: usize = 4096;
/// Payload bytes of the appends waiting for sender checks, per node. Beyond it `append_from` fails
/// `Overloaded` (one append may carry up to `machine.request_bytes_max`, 1 MiB by default).
pub(super) const SENDER_CHECK_BYTES_MAX: usize = 64 << 20;

/// The two questions of a sender check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Question {
    /// Is the user banned?
    Banned,
    /// Is the user on the channel's deny list?
    Denied,
}

/// An append waiting for its sender check.
#[derive(Debug)]
pub(super) struct WaitingAppend {
    pub api: ApiId,
    pub channel: ChannelId,
    pub sender: Uid,
    pub records: Vec<AppendRecord>,
    banned: Option<bool>,
    denied: Option<bool>,
}

/// How a check ended.
#[derive(Debug)]
pub(super) enum Verdict {
    /// The sender may send: the append goes on.
    Allowed(WaitingAppend),
    /// Refused, with the reason.
    Refused(WaitingAppend, NodeError),
}

/// Appends waiting for sender checks.
#[derive(Debug, Default)]
pub(super) struct SenderChecks {
    next: u64,
    waiting: BTreeMap<u64, WaitingAppend>,
    /// Payload bytes of the appends in `waiting`.
    bytes: usize,
}

fn payload_bytes(records: &[AppendRecord]) -> usize {
    records.iter().map(|r| r.payload.len()).sum()
}

impl SenderChecks {
    /// Starts a check for an append; gives the append back when [`SENDER_CHECKS_MAX`] appends or
    /// [`SENDER_CHECK_BYTES_MAX`] bytes are waiting.
    pub(super) fn start(
        &mut self,
        api: ApiId,
        channel: ChannelId,
        sender: Uid,
        records: Vec<AppendRecord>,
    ) -> Result<u64, Vec<AppendRecord>> {
        let bytes = payload_bytes(&records);
        if self.waiting.len() >= SENDER_CHECKS_MAX || self.bytes + bytes > SENDER_CHECK_BYTES_MAX {
            return Err(records);
        }
        self.bytes += bytes;
        self.next += 1;
        self.waiting.insert(self.next, WaitingAppend { api, channel, sender, records, banned: None, denied: None });
        Ok(self.next)
    }

    /// One answer of check `id`: the verdict once it is decided (a banned sender is refused as such
    /// whatever the deny list says, as the local check does), `None` while it waits or for a check that
    /// already ended.
    pub(super) fn answer(&mut self, id: u64, question: Question, yes: bool) -> Option<Verdict> {
        let waiting = self.waiting.get_mut(&id)?;
        match question {
            Question::Banned => waiting.banned = Some(yes),
            Question::Denied => waiting.denied = Some(yes),
        }
        let verdict = match (waiting.banned, waiting.denied) {
            (Some(true), _) => Some(NodeError::SenderBanned(waiting.sender.clone())),
            (Some(false), Some(true)) => Some(NodeError::SenderDenied(waiting.sender.clone())),
            (Some(false), Some(false)) => None,
            _ => return None,
        };
        let waiting = self.take(id).expect("present");
        Some(match verdict {
            Some(error) => Verdict::Refused(waiting, error),
            None => Verdict::Allowed(waiting),
        })
    }

    /// `true` while check `id` waits for an answer.
    pub(super) fn is_waiting(&self, id: u64) -> bool {
        self.waiting.contains_key(&id)
    }

    /// Check `id` cannot be decided (an answer could not be read): it ends refused with `error`.
    pub(super) fn fail(&mut self, id: u64, error: NodeError) -> Option<Verdict> {
        self.take(id).map(|waiting| Verdict::Refused(waiting, error))
    }

    fn take(&mut self, id: u64) -> Option<WaitingAppend> {
        let waiting = self.waiting.remove(&id)?;
        self.bytes -= payload_bytes(&waiting.records);
        Some(waiting)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidings_types::ChannelType;

    fn start(checks: &mut SenderChecks) -> u64 {
        let channel = ChannelId::new(ChannelType::GROUP, "g").unwrap();
        checks.start(ApiId(1), channel, Uid::new("alice").unwrap(), Vec::new()).unwrap()
    }

    #[test]
    fn a_check_waits_for_both_answers_and_a_ban_decides_first() {
        let mut checks = SenderChecks::default();
        let id = start(&mut checks);
        assert!(checks.answer(id, Question::Denied, false).is_none(), "the ban is not known yet");
        assert!(matches!(checks.answer(id, Question::Banned, false), Some(Verdict::Allowed(_))));
        assert!(checks.answer(id, Question::Banned, false).is_none(), "decided once");

        let id = start(&mut checks);
        assert!(checks.answer(id, Question::Denied, true).is_none(), "denied, but is it banned?");
        assert!(matches!(
            checks.answer(id, Question::Banned, false),
            Some(Verdict::Refused(_, NodeError::SenderDenied(_)))
        ));

        let id = start(&mut checks);
        let banned = checks.answer(id, Question::Banned, true);
        assert!(
            matches!(banned, Some(Verdict::Refused(_, NodeError::SenderBanned(_)))),
            "no need to wait for the deny list"
        );
        assert!(checks.answer(id, Question::Denied, false).is_none(), "a late answer to an ended check");
    }

    #[test]
    fn waiting_checks_are_bounded_and_a_failed_one_ends_once() {
        let mut checks = SenderChecks::default();
        let ids: Vec<u64> = (0..SENDER_CHECKS_MAX).map(|_| start(&mut checks)).collect();
        let channel = ChannelId::new(ChannelType::GROUP, "g").unwrap();
        assert!(checks.start(ApiId(2), channel, Uid::new("bob").unwrap(), Vec::new()).is_err());
        let unverified = || NodeError::SenderUnverified(Uid::new("alice").unwrap());
        assert!(matches!(checks.fail(ids[0], unverified()), Some(Verdict::Refused(..))));
        assert!(checks.fail(ids[0], unverified()).is_none());
        assert_eq!(checks.waiting.len(), SENDER_CHECKS_MAX - 1);
    }

    #[test]
    fn waiting_payload_bytes_are_bounded_and_given_back() {
        let mut checks = SenderChecks::default();
        let channel = ChannelId::new(ChannelType::GROUP, "g").unwrap();
        let big = || vec![AppendRecord { idempotency_key: None, payload: bytes::Bytes::from(vec![0u8; 1 << 20]) }];
        let ids: Vec<u64> = (0..64)
            .map(|_| checks.start(ApiId(1), channel.clone(), Uid::new("alice").unwrap(), big()).unwrap())
            .collect();
        assert!(checks.start(ApiId(2), channel.clone(), Uid::new("bob").unwrap(), big()).is_err(), "64 MiB waiting");
        assert!(matches!(checks.answer(ids[0], Question::Banned, true), Some(Verdict::Refused(..))));
        assert!(checks.start(ApiId(3), channel, Uid::new("bob").unwrap(), big()).is_ok(), "room given back");
        assert_eq!(checks.bytes, 64 << 20);
    }
}
