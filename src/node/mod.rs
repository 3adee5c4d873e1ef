//! The node: the sans-IO [`NodeCore`] and what configures it. The threaded runtime around it is
//! [`crate::Node`].

mod config;
mod controller;
mod core;
mod error;
mod fanout;
pub(crate) mod identity;
mod message;
pub(crate) mod peer_starts;
mod rendezvous;
pub(crate) mod shard;

pub(crate) use self::core::{fanout_work_max, first_in_order};
pub use self::core::{
    ApiId, ApiResult, ChannelStatus, LogPage, LogsListed, NodeCore, NodeEffect, NodeStatus, StrayLogConfig,
};
pub use config::{NodeConfig, QUEUE_CAPACITY_MAX};
pub use controller::{
    ControllerConfig, DrainReport, EvidenceEntry, EvidenceReport, HandOffReport, MembershipStep, MigrationPhase,
    Reconcile, SlotMigrationReport, TaskBlocked, TaskError, TaskKind, TaskReport, TaskStatus,
};
pub use error::{NodeError, Remedy};
pub use fanout::{carry_out_fanout, subscriber_page, FanoutAnswer, FanoutHost, FanoutWork, NoFanout, PageRead};
pub use message::{FlagQuery, NodeMessage, RemoteAppendError, SlotQuery, SlotReadAnswer};
pub use shard::{ActivationLoad, Lookup, LookupAnswer, ReadPlan, SenderCheck};
