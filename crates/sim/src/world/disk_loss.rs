//! A lost disk (`SimParams::disk_loss`): one node crashes once in the safety phase and starts again on
//! empty stores, undrained. Its peers must refuse it for good; requests no longer go through it, and the
//! checks of what replicas hold leave it out.

use super::{Event, World};
use std::sync::Arc;
use std::time::Duration;
use tidings::store::message::{LogLimits, MemoryLog};
use tidings::store::{IdentityStore, Kv, MemoryKv};
use tidings::types::{DetRng, NodeId};

impl World {
    /// Files the loss, when the seed draws one: which node, and when in the safety phase (its own
    /// stream, so the seed's other draws stay).
    pub(super) fn schedule_disk_loss(&mut self) {
        if !self.params.disk_loss {
            return;
        }
        let mut own = DetRng::new(self.params.seed ^ crate::params::DISK_LOSS_STREAM ^ 0x7768_656e);
        let node = NodeId::new(own.range(1, self.params.nodes));
        let after = own.range(self.params.safety_ms / 5, self.params.safety_ms * 4 / 5);
        self.schedule(self.now + Duration::from_millis(after), Event::LoseDisk { node });
    }

    /// `id` crashes and its stores are replaced by empty ones: it starts again (`restart_ms` later, or
    /// when healed) as on a new disk, without having been drained.
    pub(super) fn lose_disk(&mut self, id: NodeId) {
        self.crash(id);
        let node = self.nodes.get_mut(&id).expect("known node");
        let old: Arc<dyn Kv> = node.kv.clone();
        node.kv = Arc::new(MemoryKv::new());
        node.log = Arc::new(MemoryLog::new(LogLimits::default()));
        if self.params.unsafe_disk_loss_keeps_identity {
            let own = IdentityStore::new(old).own_or_create(|| 0).expect("memory kv reads");
            let new: Arc<dyn Kv> = node.kv.clone();
            IdentityStore::new(new).own_or_create(|| own.get()).expect("memory kv writes");
        }
        if std::env::var("SIM_DEBUG").is_ok() {
            eprintln!("{:?} {id} lost its disk", self.now);
        }
        self.lost_disk = Some(id);
        self.faults.disks_lost += 1;
    }

    /// Whether every peer must refuse the node back on an empty disk: every peer knew its first identity
    /// since setup (nothing in the workload forgets one), unless the run is the unsafe one that keeps it.
    pub(super) fn must_refuse_lost_disk(&self) -> bool {
        !self.params.unsafe_disk_loss_keeps_identity
    }

    /// Whether `to` must refuse this frame of `from`: one the node back on an empty disk sent naming its
    /// new identity (what it sent before it lost its disk names the old one, and is taken as ever).
    pub(super) fn must_refuse_frame(&self, from: NodeId, to: NodeId, bytes: &[u8]) -> bool {
        let names_new_disk = || {
            let frame = tidings::frame::decode(bytes, &tidings::frame::FrameLimits::default()).ok();
            frame.is_some_and(|f| self.lost_disk_identity == Some(f.storage))
        };
        Some(from) == self.lost_disk && from != to && self.must_refuse_lost_disk() && names_new_disk()
    }

    /// The nodes requests go through (and operator calls name): all but one that lost its disk.
    pub(super) fn serving_nodes(&self) -> Vec<NodeId> {
        self.nodes.keys().copied().filter(|id| Some(*id) != self.lost_disk && Some(*id) != self.removed).collect()
    }

    /// A node back on an empty disk was refused by its peers (`storage_changed` frames).
    pub(super) fn check_lost_disk_refused(&mut self) {
        let refusals: u64 = self
            .nodes
            .values()
            .filter_map(|n| n.core.as_ref())
            .map(|c| c.status().refused_frames.get("storage_changed").copied().unwrap_or(0))
            .sum();
        self.faults.storage_refusals += refusals;
        if let Some(lost) = self.lost_disk {
            if refusals == 0 && self.must_refuse_lost_disk() {
                self.oracle.violation(format!("{lost} came back on an empty disk and no peer refused it"));
            }
        }
    }
}
