//! OpenShell's contracts (feature `openshell`), generated from the protos vendored in `proto/openshell/` at
//! the commit pinned in its `SOURCE.md`: [`compute::v1`], the ComputeDriver service a gateway drives
//! `vm-driver serve` through, and [`v1`], the gateway's own service, whose supervisor calls
//! (`ConnectSupervisor`, `RelayStream`, `ReportMainProcessExit`, `GetSandboxConfig`) the host supervisor
//! makes for its sandbox. The modules follow the proto packages, as the generated code expects.
#![allow(missing_docs, unused_qualifications, clippy::all, clippy::pedantic, reason = "generated code")]

/// `openshell.v1`: the gateway's service.
pub mod v1 {
    tonic::include_proto!("openshell.v1");
}

/// `openshell.compute.v1`: the compute driver's service.
pub mod compute {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("openshell.compute.v1");

        impl std::fmt::Debug for DriverSandboxSpec {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct("DriverSandboxSpec")
                    .field("template", &self.template)
                    .field("command", &self.command)
                    .field("tty", &self.tty)
                    .field("sandbox_token", &if self.sandbox_token.is_empty() { "" } else { "<redacted>" })
                    .finish_non_exhaustive()
            }
        }
    }
}

/// `openshell.sandbox.v1`: the sandbox policy.
pub mod sandbox {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("openshell.sandbox.v1");
    }
}

/// `openshell.datamodel.v1`: shared resource types.
pub mod datamodel {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("openshell.datamodel.v1");
    }
}

/// `openshell.options.v1`: the protos' own options.
pub mod options {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("openshell.options.v1");
    }
}
