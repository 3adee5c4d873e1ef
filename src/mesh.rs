//! An in-process transport: several nodes in one process, for tests, examples and single-process
//! deployments. Frames are handed straight to the target node's inbox (which never blocks: a full inbox
//! drops the frame and the protocols resend).
//!
//! ```no_run
//! # fn demo() -> Result<(), tidings::node::NodeError> {
//! use std::sync::Arc;
//! use tidings::mesh::InProcessMesh;
//! use tidings::node::NodeConfig;
//! use tidings::types::NodeId;
//! use tidings::{Node, StorageOptions};
//!
//! let ids = vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)];
//! let mesh = InProcessMesh::new();
//! let mut nodes = Vec::new();
//! for id in &ids {
//!     let config = NodeConfig::new(*id, ids.clone());
//!     let node = Arc::new(Node::start(config, StorageOptions::new(format!("data/{id}")), mesh.transport(*id))?);
//!     mesh.attach(&node);
//!     nodes.push(node);
//! }
//! # Ok(()) }
//! ```

use crate::runtime::{Node, Transport};
use bytes::Bytes;
use parking_lot::RwLock;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Weak};
use tidings_types::NodeId;

/// The nodes of one process, reachable by id. Holds them weakly: dropping a node takes it off the mesh.
#[derive(Default)]
pub struct InProcessMesh {
    nodes: RwLock<BTreeMap<NodeId, Weak<Node>>>,
    /// Nodes whose frames are lost both ways (see [`InProcessMesh::isolate`]).
    isolated: RwLock<BTreeSet<NodeId>>,
}

impl InProcessMesh {
    /// An empty mesh.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The transport for node `from`: frames it sends go to the attached node they name (or nowhere).
    pub fn transport(self: &Arc<Self>, from: NodeId) -> Arc<dyn Transport> {
        Arc::new(MeshTransport { from, mesh: Arc::clone(self) })
    }

    /// Makes `node` reachable under its id (replacing a node with the same id, and ending an isolation).
    pub fn attach(&self, node: &Arc<Node>) {
        self.isolated.write().remove(&node.id());
        self.nodes.write().insert(node.id(), Arc::downgrade(node));
    }

    /// Makes node `id` unreachable: frames to it are lost, as to a crashed or partitioned node.
    pub fn detach(&self, id: NodeId) {
        self.nodes.write().remove(&id);
    }

    /// Cuts node `id` off both ways, as a crash does: frames to it are lost, and so are the frames it
    /// still sends (while it shuts down, say) until it is attached again.
    pub fn isolate(&self, id: NodeId) {
        self.isolated.write().insert(id);
        self.detach(id);
    }
}

struct MeshTransport {
    from: NodeId,
    mesh: Arc<InProcessMesh>,
}

impl Transport for MeshTransport {
    fn send(&self, to: NodeId, frame: Bytes) {
        if self.mesh.isolated.read().contains(&self.from) {
            return;
        }
        let target = self.mesh.nodes.read().get(&to).and_then(Weak::upgrade);
        if let Some(node) = target {
            node.handle_frame(self.from, frame);
            let_go(node);
        }
    }
}

/// Lets go of a node a sender held while it handed a frame over. Should the host have let go of the
/// node meanwhile, this was its last reference, and dropping it stops the node: joins its threads and
/// writes its last write-behind round, for as long as that takes. The sender is another node's thread
/// (a reactor, say) that must not wait for that, so the drop goes to a thread of its own.
fn let_go<T: Send + 'static>(node: Arc<T>) {
    if let Some(last) = Arc::into_inner(node) {
        let dropper = std::thread::Builder::new().name("tidings-mesh-drop".into());
        // Should no thread start (the process is out of threads), the drop runs here after all.
        let _ = dropper.spawn(move || drop(last));
    }
}

#[cfg(test)]
mod tests {
    use super::let_go;
    use std::sync::{Arc, Mutex};
    use std::thread::ThreadId;
    use std::time::Duration;

    /// Records the thread that dropped it.
    struct Noted(Arc<Mutex<Option<ThreadId>>>);

    impl Drop for Noted {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = Some(std::thread::current().id());
        }
    }

    #[test]
    fn a_node_let_go_by_its_last_holder_is_dropped_off_the_senders_thread_and_one_still_held_is_kept() {
        let dropped_by = Arc::new(Mutex::new(None));
        let held = Arc::new(Noted(Arc::clone(&dropped_by)));
        let_go(Arc::clone(&held));
        assert_eq!(*dropped_by.lock().unwrap(), None, "another holder keeps it");
        let_go(held);
        // Within 10 s (a thousand waits of 10 ms).
        let by = (0..1_000).find_map(|_| {
            let by = *dropped_by.lock().unwrap();
            if by.is_none() {
                std::thread::sleep(Duration::from_millis(10));
            }
            by
        });
        assert!(by.is_some(), "never dropped");
        assert_ne!(by, Some(std::thread::current().id()), "dropped on a thread of its own");
    }
}
