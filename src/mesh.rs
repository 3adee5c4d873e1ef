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
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use tidings_types::NodeId;

/// The nodes of one process, reachable by id. Holds them weakly: dropping a node takes it off the mesh.
#[derive(Default)]
pub struct InProcessMesh {
    nodes: RwLock<BTreeMap<NodeId, Weak<Node>>>,
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

    /// Makes `node` reachable under its id (replacing a node with the same id).
    pub fn attach(&self, node: &Arc<Node>) {
        self.nodes.write().insert(node.id(), Arc::downgrade(node));
    }

    /// Makes node `id` unreachable: frames to it are lost, as to a crashed or partitioned node.
    pub fn detach(&self, id: NodeId) {
        self.nodes.write().remove(&id);
    }
}

struct MeshTransport {
    from: NodeId,
    mesh: Arc<InProcessMesh>,
}

impl Transport for MeshTransport {
    fn send(&self, to: NodeId, frame: Bytes) {
        let target = self.mesh.nodes.read().get(&to).and_then(Weak::upgrade);
        if let Some(node) = target {
            node.handle_frame(self.from, frame);
        }
    }
}
