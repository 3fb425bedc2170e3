// helm_render renders a Helm chart the way `helm template` does, for tests on machines without
// the helm binary (it is not packaged in Debian): Go's text/template with the sprig functions
// Helm uses (Debian's golang-github-masterminds-sprig-dev), Helm's own functions (include, tpl,
// required, toYaml, fromYaml, toJson, fromJson, lookup), its built-in objects (.Values,
// .Release, .Chart, .Capabilities, .Template, .Files), values files deep-merged over values.yaml
// (null deletes a key), values checked against values.schema.json (gojsonschema, as Helm 3 does),
// and every rendered document parsed as YAML. Not covered: subcharts, hooks, .Files.Glob, --set.
//
//	helm_render [-f values.yaml]... [--name R] [--namespace N] [--api-versions a/v1,b/v2] CHART_DIR
//
// Prints the manifests ("---\n# Source: <chart>/templates/<file>\n...") on stdout; exit 1 with
// the reason on stderr for a schema violation, a template error or a document that is not YAML.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig" // v3 (Debian installs it without the /v3 suffix)
	"github.com/xeipuuv/gojsonschema"
	"sigs.k8s.io/yaml"
)

type valueFiles []string

func (v *valueFiles) String() string     { return strings.Join(*v, ",") }
func (v *valueFiles) Set(s string) error { *v = append(*v, s); return nil }

type files struct{ root string }

// Get returns a chart file's contents ("" when missing, as Helm does).
func (f files) Get(name string) string {
	data, err := os.ReadFile(filepath.Join(f.root, name))
	if err != nil {
		return ""
	}
	return string(data)
}

type apiVersions map[string]bool

func (a apiVersions) Has(v string) bool { return a[v] }

func readYAML(path string) (map[string]interface{}, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	out := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, nil
}

// merge lays `over` on `base` the way Helm coalesces values: maps merge key by key, anything
// else replaces, and a null removes the key.
func merge(base, over map[string]interface{}) map[string]interface{} {
	for k, v := range over {
		if v == nil {
			delete(base, k)
			continue
		}
		if vm, ok := v.(map[string]interface{}); ok {
			if bm, ok := base[k].(map[string]interface{}); ok {
				base[k] = merge(bm, vm)
				continue
			}
		}
		base[k] = v
	}
	return base
}

func toYAML(v interface{}) string {
	data, err := yaml.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(data), "\n")
}

func fromYAML(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func toJSON(v interface{}) string {
	data, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(data)
}

func fromJSON(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func run() error {
	var values valueFiles
	flag.Var(&values, "f", "values file laid over values.yaml (repeatable)")
	name := flag.String("name", "duet", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	apis := flag.String("api-versions", "", "extra API versions .Capabilities.APIVersions.Has reports, comma-separated")
	flag.Parse()
	if flag.NArg() != 1 {
		return errors.New("usage: helm_render [-f values.yaml]... [--name R] [--namespace N] CHART_DIR")
	}
	root := flag.Arg(0)

	chart, err := readYAML(filepath.Join(root, "Chart.yaml"))
	if err != nil {
		return err
	}
	vals, err := readYAML(filepath.Join(root, "values.yaml"))
	if err != nil {
		return err
	}
	for _, path := range values {
		over, err := readYAML(path)
		if err != nil {
			return err
		}
		vals = merge(vals, over)
	}
	if schema, err := os.ReadFile(filepath.Join(root, "values.schema.json")); err == nil {
		result, err := gojsonschema.Validate(gojsonschema.NewBytesLoader(schema), gojsonschema.NewGoLoader(vals))
		if err != nil {
			return fmt.Errorf("values.schema.json: %w", err)
		}
		if !result.Valid() {
			var msgs []string
			for _, e := range result.Errors() {
				msgs = append(msgs, "- "+e.String())
			}
			return fmt.Errorf("values don't meet the specifications of the schema(s):\n%s", strings.Join(msgs, "\n"))
		}
	}

	chartName, _ := chart["name"].(string)
	versions := apiVersions{"v1": true, "apps/v1": true, "policy/v1": true, "networking.k8s.io/v1": true,
		"autoscaling/v2": true}
	for _, v := range strings.Split(*apis, ",") {
		if v != "" {
			versions[v] = true
		}
	}
	top := map[string]interface{}{
		"Values": vals,
		"Release": map[string]interface{}{"Name": *name, "Namespace": *namespace, "Service": "Helm",
			"IsInstall": true, "IsUpgrade": false, "Revision": 1},
		"Chart": map[string]interface{}{"Name": chartName, "Version": chart["version"],
			"AppVersion": chart["appVersion"]},
		"Capabilities": map[string]interface{}{
			"KubeVersion": map[string]interface{}{"Version": "v1.30.0", "Major": "1", "Minor": "30",
				"GitVersion": "v1.30.0"},
			"APIVersions": versions},
		"Files": files{root: root},
	}

	tmpl := template.New("root")
	funcs := sprig.TxtFuncMap()
	delete(funcs, "env") // Helm removes these two
	delete(funcs, "expandenv")
	includeDepth := 0
	funcs["include"] = func(name string, data interface{}) (string, error) {
		if includeDepth > 1000 {
			return "", fmt.Errorf("include %q: too deep", name)
		}
		includeDepth++
		defer func() { includeDepth-- }()
		var buf bytes.Buffer
		err := tmpl.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := tmpl.Clone()
		if err != nil {
			return "", err
		}
		t, err = t.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var buf bytes.Buffer
		err = t.Execute(&buf, data)
		return strings.ReplaceAll(buf.String(), "<no value>", ""), err
	}
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil {
			return nil, errors.New(msg)
		}
		if s, ok := v.(string); ok && s == "" {
			return nil, errors.New(msg)
		}
		return v, nil
	}
	funcs["toYaml"] = toYAML
	funcs["fromYaml"] = fromYAML
	funcs["toJson"] = toJSON
	funcs["fromJson"] = fromJSON
	funcs["lookup"] = func(string, string, string, string) (map[string]interface{}, error) {
		return map[string]interface{}{}, nil // like `helm template`: no cluster to look in
	}
	tmpl.Funcs(funcs).Option("missingkey=zero")

	var names []string
	dir := filepath.Join(root, "templates")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return err
		}
		full := chartName + "/templates/" + e.Name()
		if _, err := tmpl.New(full).Parse(string(data)); err != nil {
			return err
		}
		if !strings.HasPrefix(e.Name(), "_") && (strings.HasSuffix(e.Name(), ".yaml") || strings.HasSuffix(e.Name(), ".yml")) {
			names = append(names, full)
		}
	}
	sort.Strings(names)
	var out bytes.Buffer
	for _, full := range names {
		data := map[string]interface{}{}
		for k, v := range top {
			data[k] = v
		}
		data["Template"] = map[string]interface{}{"Name": full, "BasePath": chartName + "/templates"}
		var buf bytes.Buffer
		if err := tmpl.ExecuteTemplate(&buf, full, data); err != nil {
			return err
		}
		rendered := strings.ReplaceAll(buf.String(), "<no value>", "")
		for i, doc := range strings.Split(rendered, "\n---") {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			var parsed interface{}
			if err := yaml.Unmarshal([]byte(doc), &parsed); err != nil {
				return fmt.Errorf("%s (document %d): %w\n%s", full, i, err, doc)
			}
			if parsed == nil {
				continue // only comments
			}
			fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", full, strings.TrimLeft(strings.TrimPrefix(doc, "---"), "\n"))
		}
	}
	_, err = os.Stdout.Write(out.Bytes())
	return err
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}
