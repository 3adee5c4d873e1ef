//! Activations filed to be tried again at the eviction scans: those refused for want of room or a
//! load, leaderships to start, and followers their leaders wait on, in a bounded file taken in turn.

use super::ChannelShard;
use tidings_types::ChannelId;

/// Eviction scans (one a second) at which a replica named leader while inactive is activated again
/// until it is: its leadership has work no other input may prompt.
pub(super) const LEADER_START_TRIES: u8 = 60;

/// Eviction scans at which an activation refused for want of room is tried again.
pub(super) const REFUSED_ACTIVATION_TRIES: u8 = 5;

/// Activations a shard may file to try again whatever its room ([`ChannelShard::retries_max`]). Bounded
/// by the room alone, a shard of three places held three leaders' retries, and a follower's activation
/// refused meanwhile (its leader's hint came while as many loads as places were out) was not filed: the
/// hint came again only a pull timeout later, when its leader woke its silent followers, and the leader's
/// records waited those 5 s (sim seed 536000970, MinISR all three replicas). Sixteen was too few for a
/// node keeping the replicas of dozens of busy channels on a few places: the file filled with leaderships
/// to start and followers their leaders waited on, none of which another retry may displace, and a
/// follower whose hint came then was not filed, its leader's record waiting out the append timeout
/// (sim seed 608000435: 48 channels on five nodes, three places a shard). An entry is a channel id and
/// a count; the loads a scan's retries start are bounded by the room (`loading_full`), not by this.
pub(super) const RETRIES_MIN: usize = 64;

impl ChannelShard {
    /// Files `channel` to be activated again at the next eviction scans, up to `tries` times (see
    /// `to_activate`). A channel filed already keeps the tries it has left: a retry refused again must
    /// not start its count over. When the file is full, a leadership to start takes the place of a
    /// plain follower's retry: a follower is prompted again by its leader's hints and its own pulls, but
    /// nothing else starts a leader, whose barrier, followers' wake-up and fanout of what its
    /// predecessor left wait for it (sim seed 320000242: a replica named leader while both places in
    /// the file held followers' retries was never started, and three committed messages its
    /// predecessor had handed over never reached a member). So does a follower its leader waits on
    /// (`file_awaited_follower`).
    pub(super) fn activate_later(&mut self, channel: &ChannelId, tries: u8) {
        self.file_retry(channel, tries, false);
    }

    /// Files (see [`ChannelShard::activate_later`]) a follower that news from its leader — a hint, or
    /// records — found out of memory and could not activate: that leader has records waiting for it,
    /// and, its MinISR every replica, commits nothing until it pulls. Its retry takes the place of a
    /// plain follower's in a full file, as a leadership to start does, and is taken by no other's. A
    /// leader hints a silent follower once a pull timeout; filed like any other, the retry of a follower
    /// whose hint was refused for want of a load was soon displaced by a leadership's, and the next
    /// hint, a pull timeout later, met the loads of the same round of calls: its leader committed
    /// nothing for 14 s (sim seed 590000525, 48 channels at tight limits).
    pub(super) fn file_awaited_follower(&mut self, channel: &ChannelId) {
        let replica = self.metas.get(channel).is_some_and(|known| known.meta.is_replica(self.config.node));
        if replica && !self.channels.contains(channel) {
            self.file_retry(channel, REFUSED_ACTIVATION_TRIES, true);
        }
    }

    /// Files `channel` to retry (`awaited`: for a follower its leader waits on), making room in a full
    /// file by unfiling a plain follower's retry when `channel`'s takes precedence.
    fn file_retry(&mut self, channel: &ChannelId, tries: u8, awaited: bool) {
        if self.to_activate.contains_key(channel) {
            if awaited {
                self.awaited_retries.insert(channel.clone());
            }
            return;
        }
        if self.to_activate.len() >= self.retries_max() {
            if !awaited && !self.named_leader(channel) {
                return;
            }
            let plain = self.to_activate.keys().find(|c| !self.named_leader(c) && !self.awaited_retries.contains(*c));
            let Some(plain) = plain.cloned() else { return };
            self.unfile(&plain);
        }
        self.to_activate.insert(channel.clone(), tries);
        if awaited {
            self.awaited_retries.insert(channel.clone());
        }
    }

    /// Takes `channel` out of the file of activations to try again.
    pub(super) fn unfile(&mut self, channel: &ChannelId) {
        self.to_activate.remove(channel);
        self.awaited_retries.remove(channel);
    }

    /// Most activations filed to be tried again (`to_activate`): as many as the shard may keep replicas
    /// active, and at least [`RETRIES_MIN`].
    pub(super) fn retries_max(&self) -> usize {
        self.active_max.max(RETRIES_MIN)
    }

    /// Entries of the file for replicas this shard knows to be their channel's leader, out of memory:
    /// leaderships waiting for a place to start.
    pub(super) fn leaderships_to_start(&self) -> usize {
        self.to_activate.keys().filter(|channel| !self.channels.contains(channel) && self.named_leader(channel)).count()
    }

    /// `true` if the meta this shard knows for `channel` names this node its leader.
    pub(super) fn named_leader(&self, channel: &ChannelId) -> bool {
        self.metas.get(channel).is_some_and(|known| known.meta.leader == self.config.node)
    }

    /// Tries the activations filed by `activate_later` again, one try each, while loads may be asked
    /// for; forgets those active now and those out of tries (one loading waits for its outcome). The
    /// file is taken in turn from past the entry tried last, and an entry not reached for want of a
    /// load keeps its tries: taken in name order every scan, with fewer loads to be had than entries
    /// filed, the first few took every load and one late in the file spent its tries refused (sim
    /// seeds 487000990 and 487000435: followers whose leaders waited on them, two places a shard).
    /// Followers their leaders wait on (`awaited_retries`) are taken first, in the same turn: each is
    /// what stands between a leader's records and their commit. Taken with the rest, in a file of
    /// dozens (a node keeping the replicas of 48 busy channels on three places), such a follower's turn
    /// came some fifteen scans apart, past its leader's append timeout (sim seed 569000321).
    pub(super) fn activate_again(&mut self) {
        let mut in_turn: Vec<(ChannelId, u8)> = self.to_activate.iter().map(|(c, left)| (c.clone(), *left)).collect();
        if let Some(after) = &self.retries_from {
            let past = in_turn.partition_point(|(c, _)| c <= after);
            in_turn.rotate_left(past);
        }
        // (A stable sort: each kind keeps the turn.)
        in_turn.sort_by_key(|(c, _)| !self.awaited_retries.contains(c));
        for (channel, left) in in_turn {
            if left == 0 || self.channels.contains(&channel) {
                self.unfile(&channel);
            } else if self.loading_full() {
                continue;
            } else if !self.is_loading(&channel) {
                self.to_activate.insert(channel.clone(), left - 1);
                self.retries_from = Some(channel.clone());
                self.activate(&channel);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::node::config::NodeConfig;
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use tidings_channel::machine::{ChannelMessage, PullHint};
    use tidings_store::message::MemoryLog;
    use tidings_types::{ChannelId, LeaderEpoch, NodeId};

    /// The activations filed to be tried again take the loads in turn: a scan starts past the entry
    /// tried last, and an entry not reached for want of a load keeps its tries. Taken in name order,
    /// each tried every scan, the first few took every load and one late in the file spent its tries
    /// refused for want of a load (sim seed 487000990).
    #[test]
    fn activations_filed_to_retry_take_the_loads_in_turn() {
        let (mut shard, log) = shard_with_places(2);
        // Both places held by leaders whose barriers' persists are never answered: never evicted.
        for name in ["busy-1", "busy-2"] {
            let busy = known(&mut shard, name, 1);
            shard.activate(&busy);
            carry_out_loads_and_floors(&mut shard, &log);
        }
        assert_eq!(shard.leaders_active(), 2);
        let followers: Vec<ChannelId> = (0..6).map(|i| known(&mut shard, &format!("f{i}"), 2)).collect();
        for follower in &followers {
            shard.activate_later(follower, REFUSED_ACTIVATION_TRIES);
        }
        let tries =
            |shard: &ChannelShard| followers.iter().map(|f| shard.to_activate.get(f).copied()).collect::<Vec<_>>();
        let five = Some(REFUSED_ACTIVATION_TRIES);
        let four = Some(REFUSED_ACTIVATION_TRIES - 1);

        shard.activate_again();
        assert!(shard.is_loading(&followers[0]) && shard.is_loading(&followers[1]));
        assert_eq!(tries(&shard), vec![four, four, five, five, five, five], "the rest not reached");
        shard.activate_again();
        assert_eq!(tries(&shard), vec![four, four, five, five, five, five], "no load to be had meanwhile");
        // Loaded, the first is let in past the cap (the leaders hold the followers' place), the second
        // finds no room; the next scan starts past it.
        carry_out_loads_and_floors(&mut shard, &log);
        assert!(shard.channels.contains(&followers[0]) && !shard.channels.contains(&followers[1]));
        shard.activate_again();
        assert!(shard.is_loading(&followers[2]) && shard.is_loading(&followers[3]), "the next two in turn");
        assert_eq!(tries(&shard), vec![None, four, four, four, five, five]);

        let mut loaded: BTreeSet<ChannelId> = followers[..4].iter().cloned().collect();
        for _ in 0..followers.len() * usize::from(REFUSED_ACTIVATION_TRIES) {
            loaded.extend(followers.iter().filter(|f| shard.is_loading(f)).cloned());
            carry_out_loads_and_floors(&mut shard, &log);
            shard.activate_again();
        }
        assert_eq!(loaded.len(), followers.len(), "every filed activation got a load: {loaded:?}");
        assert!(followers
            .iter()
            .all(|f| !shard.to_activate.contains_key(f) || shard.channels.contains(f) || shard.is_queued_for_room(f)));
    }

    /// A follower whose leader's hint finds the loads taken and the file of retries full takes the place
    /// of a plain follower's retry there, and a leadership to start then takes another's, not its
    /// (sim seed 590000525).
    #[test]
    fn a_follower_its_leader_waits_on_takes_a_plain_retrys_place_in_a_full_file() {
        let (mut shard, _log) = shard_with_places(2);
        let max = shard.retries_max();
        let plain: Vec<ChannelId> = (0..max).map(|i| known(&mut shard, &format!("f{i:03}"), 2)).collect();
        for follower in &plain {
            shard.activate_later(follower, REFUSED_ACTIVATION_TRIES);
        }
        for name in ["loading-a", "loading-b"] {
            let other = known(&mut shard, name, 2);
            shard.activate(&other);
        }
        assert!(shard.loading_full() && shard.to_activate.len() == max);

        let awaited = known(&mut shard, "awaited", 2);
        let hint = PullHint { channel: awaited.clone(), leader_epoch: LeaderEpoch::new(2) };
        shard.channel_message(NodeId::new(2), ChannelMessage::Hint(hint));
        assert!(!shard.is_loading(&awaited), "no load to be had");
        assert!(shard.to_activate.contains_key(&awaited), "filed in a plain retry's place");
        assert_eq!(shard.to_activate.len(), max);

        let leader = known(&mut shard, "leader", 1);
        shard.activate_later(&leader, LEADER_START_TRIES);
        assert!(shard.to_activate.contains_key(&leader) && shard.to_activate.contains_key(&awaited));
        // Taken out of the file, it is a plain retry again should it come back.
        shard.unfile(&awaited);
        assert!(shard.awaited_retries.is_empty());
    }

    /// A shard of three places on a node keeping the replicas of dozens of busy channels files the
    /// retry of every one of them that is refused: leaderships to start and followers their leaders wait
    /// on alike. Filed to sixteen, a follower whose hint found the file full of such retries was not
    /// filed, and its leader's next hint came a pull timeout later (sim seed 608000435).
    #[test]
    fn a_shard_of_few_places_files_the_retries_of_dozens_of_awaited_replicas() {
        let (mut shard, _log) = shard_with_places(3);
        for name in ["loading-a", "loading-b", "loading-c"] {
            let other = known(&mut shard, name, 2);
            shard.activate(&other);
        }
        assert!(shard.loading_full());
        let leaders: Vec<ChannelId> = (0..20).map(|i| known(&mut shard, &format!("l{i:02}"), 1)).collect();
        for leader in &leaders {
            shard.activate_later(leader, LEADER_START_TRIES);
        }
        let followers: Vec<ChannelId> = (0..28).map(|i| known(&mut shard, &format!("f{i:02}"), 2)).collect();
        for follower in &followers {
            let hint = PullHint { channel: follower.clone(), leader_epoch: LeaderEpoch::new(2) };
            shard.channel_message(NodeId::new(2), ChannelMessage::Hint(hint));
        }
        let unfiled: Vec<&ChannelId> =
            leaders.iter().chain(&followers).filter(|c| !shard.to_activate.contains_key(*c)).collect();
        assert!(unfiled.is_empty(), "not filed: {unfiled:?}");
        assert_eq!(shard.awaited_retries.len(), followers.len());
    }

    /// With one load to be had, a filed follower its leader waits on is tried before the leaderships and
    /// the plain followers filed before it, whatever the turn.
    #[test]
    fn a_follower_its_leader_waits_on_is_retried_before_the_other_filed_activations() {
        let (mut shard, _log) = shard_with_places(2);
        let loading: Vec<ChannelId> = ["loading-a", "loading-b"].iter().map(|n| known(&mut shard, n, 2)).collect();
        for other in &loading {
            shard.activate(other);
        }
        assert!(shard.loading_full());
        let mut others: Vec<ChannelId> = (0..4).map(|i| known(&mut shard, &format!("a-leader-{i}"), 1)).collect();
        for leader in &others {
            shard.activate_later(leader, LEADER_START_TRIES);
        }
        others.push(known(&mut shard, "b-follower", 2));
        shard.activate_later(&others[4], REFUSED_ACTIVATION_TRIES);
        let awaited = known(&mut shard, "z-awaited", 2);
        let hint = PullHint { channel: awaited.clone(), leader_epoch: LeaderEpoch::new(2) };
        shard.channel_message(NodeId::new(2), ChannelMessage::Hint(hint));
        assert!(shard.awaited_retries.contains(&awaited), "filed as awaited");

        // One load comes back.
        shard.loading.remove(&loading[0]);
        shard.activate_again();
        assert!(shard.is_loading(&awaited), "the awaited follower takes the load");
        assert!(others.iter().all(|c| !shard.is_loading(c) && shard.to_activate.contains_key(c)));
    }

    /// The file of activations to retry holds at most `retries_max` channels (the room, at least
    /// `RETRIES_MIN`); a leadership to start takes the place of a follower's retry when it is full,
    /// never of another leadership.
    #[test]
    fn a_leadership_to_start_takes_a_followers_place_in_a_full_file_of_retries() {
        let config = NodeConfig { active_channels_max: 2, ..NodeConfig::new(ME, vec![ME, NodeId::new(2)]) };
        let mut shard = super::super::test_shard(config, Arc::new(MemoryLog::new(Default::default())));
        let max = shard.retries_max();
        assert_eq!((shard.active_max, max), (2, RETRIES_MIN));
        let followers: Vec<ChannelId> = (0..=max).map(|i| known(&mut shard, &format!("f{i:03}"), 2)).collect();
        let leaders: Vec<ChannelId> = (0..=max).map(|i| known(&mut shard, &format!("l{i:03}"), 1)).collect();
        for follower in &followers {
            shard.activate_later(follower, REFUSED_ACTIVATION_TRIES);
        }
        assert_eq!(shard.to_activate.keys().collect::<Vec<_>>(), followers[..max].iter().collect::<Vec<_>>(), "full");
        shard.activate_later(&leaders[0], LEADER_START_TRIES);
        assert!(shard.to_activate.contains_key(&leaders[0]) && shard.to_activate.len() == max);
        // Filed again, it keeps its tries; a follower's retry does not take a leadership's place.
        shard.to_activate.insert(leaders[0].clone(), 7);
        shard.activate_later(&leaders[0], LEADER_START_TRIES);
        shard.activate_later(&followers[max], REFUSED_ACTIVATION_TRIES);
        assert_eq!(shard.to_activate.get(&leaders[0]), Some(&7));
        assert!(!shard.to_activate.contains_key(&followers[max]));
        for leader in &leaders[1..max] {
            shard.activate_later(leader, LEADER_START_TRIES);
        }
        assert_eq!(shard.to_activate.keys().collect::<Vec<_>>(), leaders[..max].iter().collect::<Vec<_>>());
        // Full of leaderships, the file takes no more: it stays bounded.
        shard.activate_later(&leaders[max], LEADER_START_TRIES);
        assert_eq!(shard.to_activate.len(), max);
        assert!(!shard.to_activate.contains_key(&leaders[max]));
    }
}
