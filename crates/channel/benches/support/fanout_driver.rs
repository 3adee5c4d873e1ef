//! Drives a `FanoutPlanner` through one message's fanout against an in-memory subscriber store (10%
//! online over 3 nodes), answering every effect at once. Shared by the criterion bench
//! (`benches/fanout.rs`) and the `fanout_bench` example, which includes this file by path.

use tidings_channel::fanout::{FanoutConfig, FanoutEffect, FanoutPlanner, Member, MessageRef, Target};
use tidings_types::{ChannelId, ChannelType, NodeId, Seq};

/// What one fanout did.
#[derive(Debug, Default)]
pub struct FanoutRun {
    /// Delivery plans emitted.
    pub plans: usize,
    /// Member entries in those plans (online members).
    pub entries: usize,
    /// Members looked up (paged).
    pub located: usize,
    /// Most plans the planner held at once.
    pub most_pending: usize,
}

/// The subscriber store of a group with `members` members.
pub fn member_store(members: usize) -> Vec<String> {
    (0..members).map(|i| format!("u{i:08}")).collect()
}

/// Fans one message out to every member of `store`.
pub fn fan_out(store: &[String]) -> FanoutRun {
    let online = |i: usize| (i % 10 == 0).then(|| Target { node: NodeId::new(1 + (i % 3) as u64) });
    let mut run = FanoutRun::default();
    let mut planner = FanoutPlanner::new(FanoutConfig::default());
    let message =
        MessageRef { channel: ChannelId::new(ChannelType::GROUP, "huge").unwrap(), seq: Seq::new(1), sender: None };
    planner.submit(message, None).unwrap();
    while let Some(effect) = planner.poll_effect() {
        match effect {
            FanoutEffect::FetchPage { job, cursor, limit, .. } => {
                let start = cursor.map_or(0, |c| usize::from_le_bytes(c.try_into().unwrap()));
                let end = (start + limit).min(store.len());
                let page = store[start..end]
                    .iter()
                    .map(|uid| Member { uid: uid.clone(), left: false, hidden: false, denied: false })
                    .collect();
                let next = (end < store.len()).then(|| end.to_le_bytes().to_vec());
                planner.handle_page(job, page, next);
            }
            FanoutEffect::Locate { job, uids } => {
                let first: usize = uids.first().map_or(0, |u| u[1..].parse().unwrap());
                run.located += uids.len();
                let targets = (first..first + uids.len()).map(online).collect();
                planner.handle_located(job, targets);
            }
            FanoutEffect::Deliver(plan) => {
                run.most_pending = run.most_pending.max(planner.plans_pending());
                run.plans += 1;
                run.entries += plan.members.len();
                planner.handle_delivered(plan.id, true);
            }
            FanoutEffect::Failed(_) | FanoutEffect::Finished { .. } => {}
        }
    }
    run
}
