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
        }
    }
}
