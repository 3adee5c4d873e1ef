//! Subscriber lists against what was acknowledged. Where the last change asked for a (channel, user)
//! pair was acknowledged, and every earlier change to the pair was acknowledged before that last one
//! was asked for, the order of their commits is known: every replica of the group owning the channel's
//! hash slot must show the pair as the last change left it. A change applied twice (a forwarded
//! proposal delivered again after a later change), a removal lost in a slot migration's marks, or a
//! snapshot missing a key breaks it. A pair with a change refused, unanswered or racing another is not
//! checked: its commit order is not known.

use super::World;
use std::collections::BTreeMap;
use tidings::node::{ApiId, ApiResult};
use tidings::slot::command::{MemberList, RoutingKey};
use tidings::slot::model::Uid;
use tidings::types::{ChannelId, Time};

/// One subscriber change asked for.
pub(super) struct MemberChange {
    channel: ChannelId,
    uids: Vec<Uid>,
    add: bool,
    asked: Time,
    /// When it was acknowledged applied (`None`: refused, failed or unanswered).
    acknowledged: Option<Time>,
}

impl World {
    /// A subscriber change was asked for as request `api`.
    pub(super) fn member_change_asked(&mut self, api: ApiId, channel: ChannelId, uids: Vec<Uid>, add: bool) {
        let change = MemberChange { channel, uids, add, asked: self.now, acknowledged: None };
        self.member_changes.insert(api, change);
    }

    /// Request `api` was answered with `result`: a subscriber change's acknowledgement is noted.
    pub(super) fn member_change_answered(&mut self, api: ApiId, result: &ApiResult) {
        if let Some(change) = self.member_changes.get_mut(&api) {
            if matches!(result, ApiResult::Meta(Ok(()))) {
                change.acknowledged = Some(self.now);
            }
        }
    }

    /// Once healed: every pair whose last change is known shows it on every replica of its group.
    pub(super) fn check_subscribers(&mut self) {
        let mut by_pair: BTreeMap<(&ChannelId, &Uid), Vec<&MemberChange>> = BTreeMap::new();
        for change in self.member_changes.values() {
            for uid in &change.uids {
                by_pair.entry((&change.channel, uid)).or_default().push(change);
            }
        }
        let mut expected = Vec::new();
        for ((channel, uid), changes) in by_pair {
            let Some(last) = changes.iter().max_by_key(|c| c.asked) else { continue };
            let ordered = last.acknowledged.is_some()
                && changes
                    .iter()
                    .filter(|c| !std::ptr::eq(**c, *last))
                    .all(|c| c.acknowledged.is_some_and(|t| t < last.asked));
            if ordered {
                expected.push((channel.clone(), uid.clone(), last.add));
            }
        }
        self.faults.subscribers_checked += expected.len() as u64;
        for (channel, uid, subscribed) in expected {
            let slot = tidings::router::hash_slot(RoutingKey::Channel(&channel).bytes());
            let group = self.owner_of(slot);
            let members = self.group_members(group);
            for (id, node) in self.nodes.iter().filter(|(id, _)| members.contains(id)) {
                let Some(core) = node.core.as_ref() else { continue };
                let found = core.reader().is_member_in(group, &channel, MemberList::Subscribers, &uid);
                if !matches!(found, Ok(shown) if shown == subscribed) {
                    self.oracle.violation(format!(
                        "{id}: {} subscribed to {channel} is {found:?} in {group}, but its last acknowledged change left it {subscribed}",
                        uid.as_str()
                    ));
                }
            }
        }
    }
}
