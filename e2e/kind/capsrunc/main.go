// capsrunc runs runc after taking out of a container's OCI spec the capabilities this machine cannot
// grant. Where the capability bounding set of every process lacks one (here CAP_SYS_RESOURCE), runc
// fails a privileged container ("unable to apply caps: operation not permitted"); kind starts every
// node with --privileged, and the node's own containerd asks the same for privileged pods. On
// `create` and `run` it rewrites the bundle's config.json, on `exec` the --process file (docker exec
// --privileged, kubectl exec into a privileged pod), so that each capability set keeps only what this
// process's bounding set holds, then execs the real runc with the same arguments.
//
// The real runc: $CAPSRUNC_RUNC, else the first of /usr/sbin/runc, /usr/bin/runc, /usr/local/sbin/runc.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// The capability names by number (linux/capability.h), as OCI specs spell them.
var capNames = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
	"CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
	"CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
	"CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
	"CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN",
	"CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF",
	"CAP_CHECKPOINT_RESTORE",
}

func realRunc() string {
	if p := os.Getenv("CAPSRUNC_RUNC"); p != "" {
		return p
	}
	for _, p := range []string{"/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc"} {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p
		}
	}
	return "runc"
}

// grantable: the capabilities in this process's bounding set (CapBnd in /proc/self/status).
func grantable() (map[string]bool, error) {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "CapBnd:"); ok {
			mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return nil, err
			}
			out := map[string]bool{}
			for i, name := range capNames {
				if mask&(1<<uint(i)) != 0 {
					out[name] = true
				}
			}
			return out, nil
		}
	}
	return nil, fmt.Errorf("no CapBnd line in /proc/self/status")
}

// specFile: the file holding the capabilities to filter, and whether it is a whole spec (config.json in
// the --bundle/-b directory of create/run; runc's default is the working directory) or a process (the
// --process/-p file of exec; without one exec takes its process from the command line: nothing to do).
func specFile(args []string) (path string, whole bool, ok bool) {
	cmd := -1
	for i, a := range args {
		if a == "create" || a == "run" || a == "exec" {
			cmd = i
			break
		}
	}
	if cmd < 0 {
		return "", false, false
	}
	long, short := "--bundle", "-b"
	if args[cmd] == "exec" {
		long, short = "--process", "-p"
	}
	for i := cmd + 1; i < len(args); i++ {
		a := args[i]
		if (a == long || a == short) && i+1 < len(args) {
			return value(args[cmd], args[i+1]), args[cmd] != "exec", true
		}
		if v, ok := strings.CutPrefix(a, long+"="); ok {
			return value(args[cmd], v), args[cmd] != "exec", true
		}
	}
	if args[cmd] == "exec" {
		return "", false, false
	}
	return value(args[cmd], "."), true, true
}

func value(cmd, v string) string {
	if cmd == "exec" {
		return v
	}
	return filepath.Join(v, "config.json")
}

func filterSpec(path string, whole bool, keep map[string]bool) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var spec map[string]any
	if err := json.Unmarshal(data, &spec); err != nil {
		return err
	}
	process := spec
	if whole {
		process, _ = spec["process"].(map[string]any)
	}
	caps, _ := process["capabilities"].(map[string]any)
	if caps == nil {
		return nil
	}
	changed := false
	for set, v := range caps {
		list, _ := v.([]any)
		kept := make([]any, 0, len(list))
		for _, c := range list {
			if name, _ := c.(string); keep[name] {
				kept = append(kept, c)
			} else {
				changed = true
			}
		}
		caps[set] = kept
	}
	if !changed {
		return nil
	}
	out, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	tmp := path + ".capsrunc"
	if err := os.WriteFile(tmp, out, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func main() {
	args := os.Args[1:]
	if path, whole, ok := specFile(args); ok {
		keep, err := grantable()
		if err == nil {
			err = filterSpec(path, whole, keep)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "capsrunc: %v\n", err)
			os.Exit(1)
		}
	}
	runc := realRunc()
	err := syscall.Exec(runc, append([]string{runc}, args...), os.Environ())
	fmt.Fprintf(os.Stderr, "capsrunc: exec %s: %v\n", runc, err)
	os.Exit(1)
}
