//! The fanout planner against a subscriber store, a presence map and a delivery sink.

use std::collections::{BTreeMap, BTreeSet};
use tidings_channel::fanout::{FanoutConfig, FanoutEffect, FanoutPlanner, JobId, Member, MessageRef, Target};
use tidings_types::{ChannelId, ChannelType, NodeId, Seq};

/// The host side: subscribers (sorted, cursor = last uid), presence, and what was delivered.
struct Host {
    members: BTreeMap<String, Member>,
    online: BTreeMap<String, Target>,
    delivered: BTreeMap<(String, u64), u32>,
    unhidden: BTreeSet<String>,
    senders: BTreeSet<String>,
    finished: Vec<JobId>,
    /// Deliveries are acknowledged only when true (to test backpressure).
    ack: bool,
    unacked: Vec<u64>,
    fetches: usize,
}

impl Host {
    fn new(n: usize, online_every: usize) -> Self {
        let mut members = BTreeMap::new();
        let mut online = BTreeMap::new();
        for i in 0..n {
            let uid = format!("u{i:07}");
            members.insert(uid.clone(), Member { uid: uid.clone(), left: false, hidden: false, denied: false });
            if i % online_every == 0 {
                online.insert(uid, Target { node: NodeId::new(1 + (i % 3) as u64) });
            }
        }
        Host {
            members,
            online,
            delivered: BTreeMap::new(),
            unhidden: BTreeSet::new(),
            senders: BTreeSet::new(),
            finished: Vec::new(),
            ack: true,
            unacked: Vec::new(),
            fetches: 0,
        }
    }

    /// Runs the planner's effects until quiet; `between_pages` may change membership mid-fanout.
    fn drive(&mut self, planner: &mut FanoutPlanner, mut between_pages: impl FnMut(&mut Self, usize)) {
        let mut pending_locate: BTreeMap<JobId, Vec<String>> = BTreeMap::new();
        while let Some(effect) = planner.poll_effect() {
            match effect {
                FanoutEffect::FetchPage { job, cursor, limit, .. } => {
                    between_pages(self, self.fetches);
                    self.fetches += 1;
                    let after = cursor.map(|c| String::from_utf8(c).unwrap());
                    let page: Vec<Member> = self
                        .members
                        .values()
                        .filter(|m| after.as_ref().is_none_or(|a| m.uid > *a))
                        .take(limit)
                        .cloned()
                        .collect();
                    let next = (page.len() == limit).then(|| page.last().unwrap().uid.clone().into_bytes());
                    planner.handle_page(job, page, next);
                }
                FanoutEffect::Locate { job, uids } => {
                    pending_locate.insert(job, uids.clone());
                    let targets = uids.iter().map(|u| self.online.get(u).cloned()).collect();
                    planner.handle_located(job, targets);
                }
                FanoutEffect::Deliver(plan) => {
                    for entry in &plan.members {
                        *self.delivered.entry((entry.uid.clone(), plan.message.seq.get())).or_default() += 1;
                        if entry.unhide {
                            self.unhidden.insert(entry.uid.clone());
                        }
                        if entry.is_sender {
                            self.senders.insert(entry.uid.clone());
                        }
                    }
                    if self.ack {
                        planner.handle_delivered(plan.id, true);
                    } else {
                        self.unacked.push(plan.id);
                    }
                }
                FanoutEffect::Failed(plan) => panic!("plan failed: {plan:?}"),
                FanoutEffect::Finished { job, .. } => self.finished.push(job),
            }
        }
    }
}

fn message(seq: u64) -> MessageRef {
    MessageRef {
        channel: ChannelId::new(ChannelType::GROUP, "big").unwrap(),
        seq: Seq::new(seq),
        sender: Some("u0000000".into()),
    }
}

#[test]
fn every_online_subscriber_gets_exactly_one_entry_per_message() {
    let mut host = Host::new(2_500, 7);
    let mut planner =
        FanoutPlanner::new(FanoutConfig { page_size: 1000, plan_members_max: 50, ..FanoutConfig::default() });
    for seq in 1..=3 {
        planner.submit(message(seq), None).unwrap();
    }
    host.drive(&mut planner, |_, _| {});
    assert_eq!(host.finished.len(), 3);
    for seq in 1..=3u64 {
        for uid in host.members.keys() {
            let count = host.delivered.get(&(uid.clone(), seq)).copied().unwrap_or(0);
            let expected = u32::from(host.online.contains_key(uid));
            assert_eq!(count, expected, "{uid} at {seq}");
        }
    }
    assert!(host.senders.contains("u0000000"), "the sender is flagged");
}

#[test]
fn left_and_denied_members_are_skipped_hidden_ones_unhidden() {
    let mut host = Host::new(30, 1);
    host.members.get_mut("u0000001").unwrap().left = true;
    host.members.get_mut("u0000002").unwrap().denied = true;
    host.members.get_mut("u0000003").unwrap().hidden = true;
    let mut planner = FanoutPlanner::new(FanoutConfig { page_size: 8, ..FanoutConfig::default() });
    planner.submit(message(1), None).unwrap();
    host.drive(&mut planner, |_, _| {});
    assert!(!host.delivered.contains_key(&("u0000001".into(), 1)));
    assert!(!host.delivered.contains_key(&("u0000002".into(), 1)));
    assert!(host.unhidden.contains("u0000003"));
    assert_eq!(host.delivered.len(), 28);
}

/// Documented behaviour: membership changes apply to pages not yet read.
#[test]
fn members_added_or_removed_mid_fanout_follow_the_cursor() {
    let mut host = Host::new(40, 1);
    let mut planner = FanoutPlanner::new(FanoutConfig { page_size: 10, ..FanoutConfig::default() });
    planner.submit(message(1), None).unwrap();
    host.drive(&mut planner, |host, fetch| {
        if fetch == 2 {
            // After pages 1-2 were read: drop one member ahead of the cursor, add one ahead and one behind.
            host.members.remove("u0000035");
            for uid in ["u0000039x", "u0000001x"] {
                host.members.insert(uid.into(), Member { uid: uid.into(), left: false, hidden: false, denied: false });
                host.online.insert(uid.into(), Target { node: NodeId::new(1) });
            }
        }
    });
    assert!(!host.delivered.contains_key(&("u0000035".into(), 1)), "removed ahead of the cursor: skipped");
    assert!(host.delivered.contains_key(&("u0000039x".into(), 1)), "added ahead of the cursor: delivered");
    assert!(!host.delivered.contains_key(&("u0000001x".into(), 1)), "added behind the cursor: not this message");
    assert!(host.delivered.values().all(|n| *n == 1));
}

#[test]
fn unacknowledged_deliveries_slow_the_planner_instead_of_growing_memory() {
    let mut host = Host::new(10_000, 1);
    host.ack = false;
    let config =
        FanoutConfig { page_size: 100, plan_members_max: 10, plans_in_flight_max: 8, ..FanoutConfig::default() };
    let mut planner = FanoutPlanner::new(config);
    planner.submit(message(1), None).unwrap();
    host.drive(&mut planner, |_, _| {});
    // One page became 10 plans; 8 were handed out, then everything waits for acknowledgements.
    assert_eq!(host.fetches, 1);
    assert_eq!(host.unacked.len(), 8);
    // At most one page of plans exists: 100 members over 3 targets in plans of 10.
    assert!(planner.plans_pending() <= 100 / 10 + 3, "{}", planner.plans_pending());
    host.ack = true;
    for id in std::mem::take(&mut host.unacked) {
        planner.handle_delivered(id, true);
    }
    host.drive(&mut planner, |_, _| {});
    assert_eq!(host.finished.len(), 1);
    assert_eq!(host.delivered.len(), 10_000);
}

#[test]
fn person_channels_take_the_fast_path() {
    let mut host = Host::new(0, 1);
    host.online.insert("alice".into(), Target { node: NodeId::new(2) });
    let mut planner = FanoutPlanner::new(FanoutConfig::default());
    let person = MessageRef {
        channel: ChannelId::new(ChannelType::PERSON, "alice@bob").unwrap(),
        seq: Seq::new(4),
        sender: Some("bob".into()),
    };
    planner.submit(person, Some(["alice".into(), "bob".into()])).unwrap();
    host.drive(&mut planner, |_, _| {});
    assert_eq!(host.fetches, 0, "no paging for a person channel");
    assert_eq!(host.delivered.get(&("alice".into(), 4)), Some(&1));
    assert!(!host.delivered.contains_key(&("bob".into(), 4)), "offline");
}
